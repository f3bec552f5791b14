"""The helpers and fixtures of tests/unit/test_stdit.py that other test modules use too: `B`, `S` (a test module
imports no other test module)."""



B = 2
T, H, W = 3, 4, 4                       # debug-stdit's token grid: 3 frames of 4 x 4 patches
S = T * H * W
