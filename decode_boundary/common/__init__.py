"""Device helpers shared by the GEMM, the all-reduce and the mixes kernels:
``rounding`` (BF16 and MXFP8 rounding, the scale swizzle), ``mailbox_store``
(the store every mailbox publisher makes), ``tagged_words`` (tagged words and
bounded spins), ``contract`` (the publish contract and the mix row's
geometry), ``compiled`` (loading a kernel compiled ahead), ``timeline`` (the
kernels' per-program stamps; their analysis and the timer are in ``bench``).
They import nothing of this package but its formats."""
