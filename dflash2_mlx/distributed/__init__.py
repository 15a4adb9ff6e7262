"""A target split over ``mx.distributed`` ranks under the DFlash loop (tensor parallel through
mlx-lm's ``shard``, pipeline over contiguous layer ranges), and what the ranks check and
agree on so that every rank runs the same cycle."""
