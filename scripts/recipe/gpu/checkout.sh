#!/usr/bin/env bash
# How does the checkout travel light? The shipped drafters moved out of it for the GPU calls.
#
#   scripts/recipe/gpu/checkout.sh slim      before the first call
#   scripts/recipe/gpu/checkout.sh restore   after the last one
#
# Every device call sends the checkout with what it carries, 64 MiB in all; the shipped
# drafters are most of the checkout (about 26 MB) and the GPU run reads its warm start from
# the carry.  `slim` takes them out of git's index and moves them to .carry/aside (ignored,
# so they do not travel); `restore` puts both back.  Nothing is committed either way.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
cd "$ROOT"
DRAFTERS=dflash2_mlx/builtin/drafters
ASIDE=.carry/aside
case "${1:-}" in
    slim)
        [[ -d $ASIDE/$DRAFTERS ]] && { echo "already slim: $ASIDE/$DRAFTERS exists"; exit 1; }
        mkdir -p "$ASIDE/$(dirname $DRAFTERS)"
        git rm -r -q --cached "$DRAFTERS"
        mv "$DRAFTERS" "$ASIDE/$DRAFTERS"
        echo "slim: $(git ls-files | xargs du -cb 2>/dev/null | tail -1 | cut -f1) bytes tracked";;
    restore)
        [[ -d $ASIDE/$DRAFTERS ]] || { echo "nothing to restore in $ASIDE"; exit 1; }
        mv "$ASIDE/$DRAFTERS" "$DRAFTERS"
        git reset -q -- "$DRAFTERS"
        git status --short "$DRAFTERS"
        echo "restored";;
    *) echo "usage: $0 slim|restore"; exit 2;;
esac
