"""Hand-computed MXFP8 vectors shared by the reference and the kernel tests.

Every expected byte is worked out by hand from docs/DESIGN.md §4 (see the notes on
each entry), not by running either implementation.
"""

import math

NAN, INF = math.nan, math.inf

# (values, expected element bytes, expected scale byte), all hand-computed.
HAND_VECTORS = {
    # amax 448 -> 448/448 = 1.0 = 2^0 exactly -> byte 127, scale 1. 1.0 = 0x38.
    # 1.0625 ties 1.0 (0x38, even) / 1.125 (0x39) -> 0x38; 1.1875 ties 0x39 / 0x3A -> 0x3A;
    # 1.9375 ties 1.875 (0x3F) / 2.0 (0x40): the even one carries into the exponent.
    "ties_to_even": (
        [448.0, 1.0, 1.0625, 1.1875, 1.9375, -1.0625, -1.1875],
        [0x7E, 0x38, 0x38, 0x3A, 0x40, 0xB8, 0xBA],
        127,
    ),
    # 440 lies between 416 (0x7D) and 448: nearer 448. -448 = 0xFE.
    "saturate_448": ([448.0, 440.0, -448.0, -440.0], [0x7E, 0x7E, 0xFE, 0xFE], 127),
    # Scale 1; e4m3 subnormals m * 2^-9: 2^-9 -> 1, 3*2^-9 -> 3, 2^-10 ties 0/1 -> 0,
    # 1.5*2^-9 ties 1/2 -> 2, 2^-7 -> 4, 7.5*2^-9 ties 7/8 -> 8 = 0x08 (smallest normal),
    # 2^-6 -> 0x08, 2^-11 -> 0, -2^-9 -> 0x81.
    "subnormal_elements": (
        [448.0, 2**-9, 3 * 2**-9, 2**-10, 1.5 * 2**-9, 2**-7, 7.5 * 2**-9, 2**-6, 2**-11, -(2**-9)],
        [0x7E, 0x01, 0x03, 0x00, 0x02, 0x04, 0x08, 0x08, 0x00, 0x81],
        127,
    ),
    # amax 500: 500/448 = 1.116 -> exponent 127, mantissa != 0 -> 128, scale 2;
    # 500/2 = 250 between 240 (0x77) and 256 (0x78): nearer 256.
    "round_up_scale": ([500.0, 3.0], [0x78, 0x3C], 128),
    # amax 1: 1/448 = 1.14 * 2^-9 -> byte 118 + 1 = 119, scale 2^-8: 1 -> 256 = 0x78.
    "amax_one": ([1.0, -0.5], [0x78, 0xF0], 119),
    # amax 2^-120: 2^-120/448 is an FP32 subnormal (exponent field 0, mantissa != 0)
    # -> byte 1, scale 2^-126: 2^-120 * 2^126 = 64 = 0x68.
    "subnormal_amax_over_448": ([2**-120, -(2**-121)], [0x68, 0xE0], 1),
    # amax 0: byte 0 and zeros keep their sign.
    "amax_zero": ([0.0, -0.0, 0.0], [0x00, 0x80, 0x00], 0),
    # NaN: byte 254, NaN -> 0x7F whatever its sign, finite x / 2^127 -> signed zero.
    "nan": ([NAN, 1.0, -NAN, -1.0], [0x7F, 0x00, 0x7F, 0x80], 254),
    # Inf: byte 254, Inf saturates to +-448, finite x / 2^127 -> signed zero.
    "inf": ([INF, -INF, 1.0, -1.0], [0x7E, 0xFE, 0x00, 0x80], 254),
}
