"""Sample `lfs getstripe` outputs, plain and `-y` YAML, for plain and PFL composite files: written from Lustre's
documented output formats (Lustre cannot be installed on the machines that run the unit tests). They are the
parser's reference inputs (tests/unit/test_lustre.py) and the layouts scripts/bench/bench_ost_model.py simulates, so
the benchmark runs without the test suite."""

# `lfs getstripe FILE` for a plain file striped over 4 OSTs (Lustre 2.x plain output).
PLAIN_MULTI = """\
/lustre/store/model-00001-of-00004.safetensors
lmm_stripe_count:  4
lmm_stripe_size:   4194304
lmm_pattern:       raid0
lmm_layout_gen:    0
lmm_stripe_offset: 5
\tobdidx\t\t objid\t\t objid\t\t group
\t     5\t      71329124\t    0x4406a64\t             0
\t     6\t      71330311\t    0x4406f07\t             0
\t     7\t      71324917\t    0x44059f5\t             0
\t     0\t      71331502\t    0x44073ae\t             0
"""

PLAIN_SINGLE = """\
/lustre/store/config.json
lmm_stripe_count:  1
lmm_stripe_size:   1048576
lmm_pattern:       raid0
lmm_layout_gen:    0
lmm_stripe_offset: 3
\tobdidx\t\t objid\t\t objid\t\t group
\t     3\t       1245611\t     0x1301ab\t             0
"""

# `lfs getstripe -y FILE` for the same kind of file (YAML).
YAML_MULTI = """\
lmm_stripe_count:  2
lmm_stripe_size:   1048576
lmm_pattern:       raid0
lmm_layout_gen:    0
lmm_stripe_offset: 1
lmm_objects:
      - l_ost_idx: 1
        l_fid:     0x100010000:0x2a:0x0
      - l_ost_idx: 2
        l_fid:     0x100020000:0x2b:0x0
"""

# A PFL composite file: 1 stripe for the first 4 MiB, 2 up to 64 MiB, 4 to EOF (plain output).
PFL_PLAIN = """\
/lustre/store/model.safetensors
  lcm_layout_gen:    3
  lcm_mirror_count:  1
  lcm_entry_count:   3
    lcme_id:             1
    lcme_mirror_id:      0
    lcme_flags:          init
    lcme_extent.e_start: 0
    lcme_extent.e_end:   4194304
      lmm_stripe_count:  1
      lmm_stripe_size:   1048576
      lmm_pattern:       raid0
      lmm_layout_gen:    0
      lmm_stripe_offset: 0
      lmm_objects:
      - 0: { l_ost_idx: 0, l_fid: [0x100000000:0x2:0x0] }

    lcme_id:             2
    lcme_mirror_id:      0
    lcme_flags:          init
    lcme_extent.e_start: 4194304
    lcme_extent.e_end:   67108864
      lmm_stripe_count:  2
      lmm_stripe_size:   1048576
      lmm_pattern:       raid0
      lmm_layout_gen:    0
      lmm_stripe_offset: 1
      lmm_objects:
      - 0: { l_ost_idx: 1, l_fid: [0x100010000:0x2:0x0] }
      - 1: { l_ost_idx: 2, l_fid: [0x100020000:0x2:0x0] }

    lcme_id:             3
    lcme_mirror_id:      0
    lcme_flags:          init
    lcme_extent.e_start: 67108864
    lcme_extent.e_end:   EOF
      lmm_stripe_count:  4
      lmm_stripe_size:   4194304
      lmm_pattern:       raid0
      lmm_layout_gen:    0
      lmm_stripe_offset: 3
      lmm_objects:
      - 0: { l_ost_idx: 3, l_fid: [0x100030000:0x3:0x0] }
      - 1: { l_ost_idx: 4, l_fid: [0x100040000:0x3:0x0] }
      - 2: { l_ost_idx: 5, l_fid: [0x100050000:0x3:0x0] }
      - 3: { l_ost_idx: 6, l_fid: [0x100060000:0x3:0x0] }
"""

# The same PFL layout as `lfs getstripe -y`; the last component not instantiated yet (small file).
PFL_YAML = """\
  lcm_layout_gen:    2
  lcm_mirror_count:  1
  lcm_entry_count:   2
  component0:
    lcme_id:             1
    lcme_mirror_id:      0
    lcme_flags:          init
    lcme_extent.e_start: 0
    lcme_extent.e_end:   4194304
    sub_layout:
      lmm_stripe_count:  1
      lmm_stripe_size:   1048576
      lmm_pattern:       raid0
      lmm_layout_gen:    0
      lmm_stripe_offset: 0
      lmm_objects:
      - l_ost_idx: 0
        l_fid:     0x100000000:0x2:0x0
  component1:
    lcme_id:             2
    lcme_mirror_id:      0
    lcme_flags:          0
    lcme_extent.e_start: 4194304
    lcme_extent.e_end:   EOF
    sub_layout:
      lmm_stripe_count:  4
      lmm_stripe_size:   1048576
      lmm_pattern:       raid0
      lmm_layout_gen:    0
      lmm_stripe_offset: -1
"""
