"""A boundary config smaller than ``tiny`` with the same structure (hc_mult 4,
grouped ``wo_a``, the same collapse), for CPU tests whose property does not
depend on the shapes (the mailbox stages' rotation, the mixes-aside dispatch,
the bench's bookkeeping): each of its interpreter steps costs about half of
a ``tiny`` step's."""

import dataclasses

from decode_boundary.model.config import MODELS

MICRO = dataclasses.replace(MODELS["tiny"], name="micro", hidden=128, n_heads=4, head_dim=32,
                            q_lora=64, kv_lora=64, o_groups=2, o_lora=64)
