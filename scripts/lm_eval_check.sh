#!/usr/bin/env bash
# lm-eval's loglikelihood path (echo + logprobs, the tokenizer routes) against a running
# `dflash2-mlx serve`: a 4-way multiple-choice task made from the first N GSM8K questions that
# ship with the package (the right final answer against answer+1, answer-1, 2x answer and
# answer+10, three of them), scored by lm-eval's local-completions model, which finds the
# server's /tokenizer_info and /tokenize routes by itself (no tokenizer to install).
#
#   pip install "lm-eval[api]"          (in the same or any other environment)
#   dflash2-mlx serve --port 8000 &
#   scripts/lm_eval_check.sh [BASE_URL] [N]    (defaults: http://127.0.0.1:8000, 40)
set -euo pipefail
BASE=${1:-http://127.0.0.1:8000}
N=${2:-40}
HERE=$(cd "$(dirname "$0")" && pwd)
TASK=$(mktemp -d)
trap 'rm -rf "$TASK"' EXIT
python3 - "$HERE/../dflash2_mlx/bench_data/gsm8k_test.jsonl" "$TASK" "$N" <<'PY'
import json, random, sys

src, out, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
rng = random.Random(0)
with open(f"{out}/gsm8k_choice.jsonl", "w") as f:
    for line in list(open(src))[:n]:
        row = json.loads(line)
        a = int(float(row["short_answer"].replace(",", "")))
        choices = [str(x) for x in [a] + sorted({a + 1, a - 1, a * 2, a + 10} - {a})[:3]]
        rng.shuffle(choices)
        f.write(json.dumps({"question": row["question"], "choices": choices, "label": choices.index(str(a))}) + "\n")
with open(f"{out}/gsm8k_choice.yaml", "w") as f:
    f.write(f"""task: gsm8k_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {out}/gsm8k_choice.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
PY
MODEL=$(curl -s "$BASE/v1/models" | python3 -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')
HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 lm_eval --model local-completions \
    --model_args "model=$MODEL,base_url=$BASE/v1/completions" --tasks gsm8k_choice --include_path "$TASK"
