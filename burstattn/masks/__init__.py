"""Masks over global positions (sliding windows, packed documents, ``mask_mod`` predicates), their
block summaries and the sparse direct schedules that skip the work and traffic they make
unnecessary."""
from ..layouts.partition import balance  # the one balance figure (max over mean of per-rank work)
from .blocks import pair_ops
from .plan import MaskPlan, choose_mask_backward, mask_bytes, mask_plan, rank_work
from .spec import AttnMask, make_mask

__all__ = ["AttnMask", "make_mask", "pair_ops", "MaskPlan", "mask_plan", "mask_bytes", "choose_mask_backward",
           "rank_work", "balance"]
