#!/bin/bash
# The quick-start prompt at TOKENS (default 128) tokens: default, --exact and --verify-mode off,
# interleaved, three rounds; each line is one run's generation tok/s and tau (from the stats line).
# quick start prompt, 128 tokens: default / --exact / --verify-mode off, interleaved, 3 rounds
P="Write a Python function that checks whether a number is prime."
for r in 1 2 3; do
  for mode in default exact off; do
    case $mode in default) a="";; exact) a="--exact";; off) a="--verify-mode off";; esac
    line=$(dflash2-mlx generate --prompt "$P" --max-tokens ${TOKENS:-128} $a 2>&1 >/dev/null | grep "tok/s" | tail -1)
    echo "$mode: $(echo "$line" | grep -o 'generation [0-9]* tokens, [0-9.]* tok/s') | $(echo "$line" | grep -o 'tau [0-9.]*')"
  done
done
