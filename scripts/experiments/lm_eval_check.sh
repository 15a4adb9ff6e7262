#!/usr/bin/env bash
# Does lm-eval run against `dflash2-mlx serve`, by loglikelihood and by generation?
#
# lm-eval against a running `dflash2-mlx serve`, on tasks made from the first N GSM8K questions
# that ship with the package; lm-eval's local-completions model finds the server's
# /tokenizer_info and /tokenize routes by itself (no tokenizer to install):
# - gsm8k_choice: loglikelihood (echo + logprobs): the right final answer against three of
#   answer+1, answer-1, 2x answer and answer+10;
# - gsm8k_gen: generation ("Question: ... Answer:", greedy, up to 128 tokens, until
#   "Question:"), the last number in the reply against the answer: DFlash's own path.
#
#   pip install "lm-eval[api]"          (in the same or any other environment)
#   dflash2-mlx serve --port 8000 &
#   scripts/experiments/lm_eval_check.sh [BASE_URL] [N] [TASKS] [lm_eval options...]
#       (defaults: http://127.0.0.1:8000, 40, gsm8k_choice; TASKS: comma-separated)
set -euo pipefail
BASE=${1:-http://127.0.0.1:8000}
N=${2:-40}
TASKS=${3:-gsm8k_choice}
shift $(( $# < 3 ? $# : 3 ))
HERE=$(cd "$(dirname "$0")" && pwd)
TASK=$(mktemp -d)
trap 'rm -rf "$TASK"' EXIT
python3 - "$HERE/../../dflash2_mlx/builtin/bench_data/gsm8k_test.jsonl" "$TASK" "$N" <<'PY'
import json, random, sys

src, out, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
rng = random.Random(0)
with open(f"{out}/gsm8k_choice.jsonl", "w") as f:
    for line in list(open(src))[:n]:
        row = json.loads(line)
        a = int(float(row["short_answer"].replace(",", "")))
        choices = [str(x) for x in [a] + sorted({a + 1, a - 1, a * 2, a + 10} - {a})[:3]]
        rng.shuffle(choices)
        f.write(json.dumps({"question": row["question"], "choices": choices, "label": choices.index(str(a)),
                            "answer": row["short_answer"]}) + "\n")
# Both tasks read the same records, with the same question prompt.
common = f"""dataset_path: json
dataset_kwargs:
  data_files:
    test: {out}/gsm8k_choice.jsonl
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
"""
tasks = {"gsm8k_choice": """output_type: multiple_choice
doc_to_choice: "{{choices}}"
doc_to_target: "{{label}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""", "gsm8k_gen": """output_type: generate_until
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["Question:"]
  max_gen_toks: 128
  do_sample: false
filter_list:
  - name: last-number
    filter:
      - function: regex
        group_select: -1
        regex_pattern: "(-?[$0-9.,]{2,})|(-?[0-9]+)"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    regexes_to_ignore: [",", "\\\\$", "\\\\.$"]
"""}
for name, body in tasks.items():
    with open(f"{out}/{name}.yaml", "w") as f:
        f.write(f"task: {name}\n" + common + body)
PY
MODEL=$(curl -s "$BASE/v1/models" | python3 -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')
HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 lm_eval --model local-completions \
    --model_args "model=$MODEL,base_url=$BASE/v1/completions" --tasks "$TASKS" --include_path "$TASK" "$@"
