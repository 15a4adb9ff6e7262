"""What a request asks for, as every surface takes it (Python, the CLI, the server, the
batch), beneath everything that serves one:

    arguments.py  the rules every surface checks generation arguments by
    sampling.py   ``SamplingParams``: the distribution a plain mlx-lm run samples from, and
                  the accept rule that keeps drafted tokens distributed as it
    modes.py      the verify modes' table (aliases resolved there only)
    prompt.py     a prompt's token ids: text, ids, or chat messages through the chat template
"""
