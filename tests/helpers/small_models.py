"""A boundary config smaller than ``tiny`` with the same structure and the
same consumer side (hidden 256, hc_mult 4: the consumer and mixes kernels run
tiny's tactics, chunks and orders), only its projections narrower (4 heads of
32, q_lora = kv_lora = o_lora = 64, 2 output groups): for CPU tests whose
property does not depend on the GEMM shapes (the mailbox stages' rotation, the
mixes-aside dispatch, the collapses, the bench's bookkeeping, precompile's
cover). Its GEMMs pick tiny's tactics at every row count the tests use; an
interpreter step costs about 60% of a ``tiny`` step."""

import dataclasses

from decode_boundary.model.config import MODELS

MICRO = dataclasses.replace(MODELS["tiny"], name="micro", n_heads=4, head_dim=32, q_lora=64,
                            kv_lora=64, o_groups=2, o_lora=64)
