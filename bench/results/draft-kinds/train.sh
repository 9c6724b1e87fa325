#!/bin/bash
# How the drafts of draft_kinds.md were trained (2026-12-07, 2-core AMD EPYC with avx512_bf16, one run after the other,
# 2 threads each): three drafts at one budget, the same data (the embedded ShareGPT corpus's own answers, conversations
# 0-383 after the 48 held out), steps (150), padded tokens per step (2048), TTT steps (3), learning rate, warm-up, seed
# (0) and recipe (the shipped smollm2-135m-instruct one: draft vocab 8192, lm_head from the target's rows); only the
# draft kind differs. Then: python -m bench.draft_kinds --drafts eagle3=$OUT/eagle3/draft,eagle3.1=$OUT/eagle3.1/draft,p-eagle=$OUT/p-eagle/draft
OUT=${OUT:-work/draft-kinds}
for kind in eagle3 eagle3.1 p-eagle; do
  python -m jobs.distill --output $OUT/$kind --steps 150 --ttt-steps 3 --lr 1e-3 --warmup-steps 10 \
    --threads 2 --checkpoint-every 75 --draft-kind $kind
done
