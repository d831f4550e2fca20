#!/usr/bin/env bash
# Issue 12's GPU measurements, on a machine with a CUDA GPU and no network.
#
# What it runs: `fastrpe bench --suite gpu` (src/fastrpe/bench/gpu.py) in one process per
# phase: compiled FlexAttention with a causal block mask, SDPA without RPE, fla's
# chunk_simple_gla / chunk_linear_attn, every fastrpe backend; B=1 H=8 D=64, 32 features,
# bf16, forward+backward; then the issue's criteria (`--check`). Phases (a phase that runs out
# of its budget stops cleanly, its rows saved one by one; run `rest` to go on):
#
#   bash benchmarks/gpu_run.sh first   # ONE call for a 15-minute session: the kernels' GPU tests
#                                      # (100 s) beside the compile warm-up (below); the kernel
#                                      # profile at 64k only if asked (PROFILE_S=45), the PRF sweep only if
#                                      # asked (PRF_S; its pick, if any, for every row after), then
#                                      # every row the criteria read at 4k, 64k, 256k and 1M,
#                                      # then decoding, then the host-sync check (resuming a
#                                      # carried JSON: the failed problems' rows and the anchors,
#                                      # Flex at 64k among them, dropped to run again, then the
#                                      # 64k ratio rows and the 4k CUDA-graph pairings first,
#                                      # PRIORITY_S=150; fla's rows (FLA_S=75, with .fla_site),
#                                      # then decoding and syncs first; in 500 s that leaves the
#                                      # bench little: `rest`)
#   bash benchmarks/gpu_run.sh rest    # what `first` left: its sections, then every other row
#                                      # (after a warm-up of its own: REST_WARM_S, REST_S/3 and
#                                      # 120 s at most by default; fla's non-criteria rows only
#                                      # in a last FLA_REST_S s)
#   bash benchmarks/gpu_run.sh short   # host-sync check, decoding at 64k, L = 4k, 16k, 64k
#   bash benchmarks/gpu_run.sh long    # L = 256k, 1M (resumes the JSON of `short`)
#   bash benchmarks/gpu_run.sh tests   # the GPU tests (pytest -m gpu)
#   bash benchmarks/gpu_run.sh auto    # auto's model pick vs measured best (auto_cpu_check.py --device cuda)
#   bash benchmarks/gpu_run.sh check   # the criteria from the JSON, nothing run
#
# Where things land: $OUT (the device tool's output folder) or runs/gpu: gpu.json (every row,
# device name, torch/triton/fla versions, the exact command), gpu.md (tables to paste into
# docs/RESULTS.md, with the criteria), gpu.png (log-log time vs L), gpu_<phase>.log (the
# warm-ups' logs folded in), gpu_tests.log (the fla probe's log appended), gpu_profile.json,
# gpu_warm.json, and from `first` and `rest` compile_cache.tar.xz (below): 8 files from `first`,
# all a device call brings back.
#
# Before the first call, on the machine with network (repo root): `bash benchmarks/gpu_prep.sh`
# does all of what follows from a fresh checkout (fla's site, both venvs, the precompiled pack;
# see its header for how long each step took); the steps one by one, for reference:
#   grep -qx '/.whl/' .git/info/exclude || echo '/.whl/' >> .git/info/exclude
#   grep -qx '/.gpu_runs/' .git/info/exclude || echo '/.gpu_runs/' >> .git/info/exclude
#   grep -qx '/.gpu_cache/' .git/info/exclude || echo '/.gpu_cache/' >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       -d .whl fla-core==0.6.0
# fla-core 0.6.0 is pure Python + Triton (fla.ops: chunk_simple_gla, chunk_linear_attn with
# [B, T, H, K] inputs, no head_first); its one required dependency, einops, is already in the
# device image, and it needs torch >= 2.7 and triton >= 3.3 (the image has torch 2.11, triton
# 3.6). The `flash-linear-attention` package (models, needs transformers) is not needed.
# But fla did not run under the image's triton 3.6 (an illegal memory access, 2026-11-26; fla
# itself asks Hopper for triton >= 3.7.1). Since 2026-11-27 the better carry is .fla_site
# instead of .whl: `bash benchmarks/fla_site.sh` (2-3 minutes here) packs fla-core with a
# trimmed triton 3.7.1 into .fla_site/site.tar.xz (37 MB), and this script then warms and
# times fla's rows in processes of their own with that triton (FLA_ENV below; FLA_S=75 s for
# the timed rows, after the profile), every other row with the image's. A row that broke the
# context under other versions is measured again (gpu.lost_elsewhere), so the carried JSON's
# fla row runs again; each run's versions are in gpu.json's `envs`:
#   run(command="bash benchmarks/gpu_run.sh first", carry=[".fla_site", ".gpu_runs", ".gpu_cache"], timeout_s=540)
#
# A session's device time is 15 minutes (since 2026-11; it was 30), counted from the machine's
# start (a minute or two) to its return, idle time included; a warm machine goes back after
# 30 s idle, and none starts with under 4 minutes left. So plan ONE call, and since one call
# measures 4k and 64k and no further, resume the last session's JSON (same GPU name only; the
# problems where a row failed are measured again whole, gpu.retry_errors; two anchor rows are
# measured again, gpu.ANCHORS, the rows whose code changed since, gpu.CHANGED, and each 64k
# problem whose ratio's two sides are from two sessions, gpu.unpaired; then those, +compiled,
# +cudagraphs and the scan twins first, PRIORITY_S):
#   mkdir -p .gpu_runs && cp benchmarks/results/gpu/h100-2026-11-28.json .gpu_runs/gpu.json
#   bash benchmarks/fla_site.sh   # once: .fla_site/site.tar.xz (kept between sessions here)
#   PYTHONPATH=src python3 benchmarks/precompile.py key-hash --expect .gpu_cache/precompiled.json
#     # (here it says "another triton": this Python's; what matters is no "changed since" list,
#     # else `compile` again from the kept specs, runs/precompile/*.json, about 1 s per kernel
#     # changed, and pack; `record` again, 8 minutes, only when the bench's rows changed)
#   run(command="bash benchmarks/gpu_run.sh first", carry=[".fla_site", ".gpu_runs", ".gpu_cache"], timeout_s=540)
# (no kind: a first call takes an H100 if one opens within 90 s, else an H200, where the H100's
# JSON does not resume and the run starts afresh.) Check the script here first:
# `OUT=/tmp/smoke SMOKE=1 bash benchmarks/gpu_run.sh first` (about a minute).
# (on 2026-11-26 the machine started in about 30 s; the second call there used FIRST_S=480 with
# timeout_s=505 because the first had spent 265 s)
# The warm-up (`fastrpe bench --suite gpu --warm first`, src/fastrpe/bench/gpu_warm.py): a cold
# bench compiles kernel after kernel, each autotuned one six times (the tuned kernels' variants
# for sm_90: 377 s on the 2-core CPU, 70 s for the slowest single config; benchmarks/
# compile_time.py, results/compile_time-sm90.json), and compiled Flex forward and backward
# per length. Six processes, one per autotuner config, run the first pass's Triton rows once
# and share out its Flex and fla rows, beside the tests, so that the bench finds the binaries
# in Triton's and Inductor's disk caches and only times the configs; the bench starts when they
# end, FIRST_WARM_S=170 s after the start at the latest. gpu_warm.json says what each compiled
# and how long it took: worth a line in RESULTS.md, and it sizes FIRST_WARM_S for next time.
# `first` ends within FIRST_S=500 s of its start (FIRST_TESTS_S=100 for the tests; the bench
# starts no new row after FIRST_S less PACK_S=35 less 85 s, and is stopped PACK_S + 25 s before
# the end; the compile caches are packed from then until 15 s before the end, the --check's), so
# the rows measured so far come back even when the last one runs long. Then here, at once (the
# machine is warm for 30 s):
#   mkdir -p .gpu_runs .gpu_cache && cp <files_at>/gpu.json .gpu_runs/
#   cp <files_at>/compile_cache.tar.xz .gpu_cache/   # if it came back (the log says why not)
#   run(command="REST_S=<seconds left, less 60> bash benchmarks/gpu_run.sh rest",
#       carry=[".fla_site", ".gpu_runs", ".gpu_cache"], timeout_s=<seconds left, less 30>)
# only if at least 3 minutes of device time remain; otherwise give the machine back. Locally:
#   fastrpe bench --suite gpu --check <files_at>/gpu.json
# With 30 minutes (if ever again): `tests` with TESTS_BUDGET=240, then `short`, then `long`.
#
# The compile cache (2026-11-27): on a fresh machine every process compiles from cold caches,
# and the warm-up reached about 10 of 36 rows in 140 s in `first` and 10 of 292 in 90 s in
# `rest`. Now every process of this script compiles into fixed folders (TRITON_CACHE_DIR and
# TORCHINDUCTOR_CACHE_DIR under /tmp/fastrpe_compile_cache: Triton's JIT kernels, Inductor's
# Triton kernels, which go to TRITON_CACHE_DIR when it is set, its FX graph and AOTAutograd
# caches; fla's processes too, their triton 3.7.1 entries keyed apart by version), a carried
# .gpu_cache/compile_cache.tar.xz is unpacked into them at the start (a few seconds), and
# `first` and `rest` pack them into $OUT/compile_cache.tar.xz in their last PACK_S=35 s
# (benchmarks/compile_cache.py: under 16 MiB, and under what the 64 MiB carry leaves beside
# this tree, .fla_site's 37 MB included; everything if it fits, else without Triton's
# intermediate stages, .source/.ttir/.ttgir/.llir/.ptx, a third of the size, with the lookup
# files rewritten to match, else the entries this session used first; it says which in the
# phase's log). After EVERY device call that brought it back, here:
#   mkdir -p .gpu_cache && cp <files_at>/compile_cache.tar.xz .gpu_cache/
# and add ".gpu_cache" to the next call's carry (it replaces the last one: the new pack holds
# what the last one held, as far as it fits). The cache only spares compiling: each session's
# autotuners still time their configs (Triton's stored autotuning results stay out of the
# pack). Measured here (triton 3.9, sm_90): the 232 compilations of tests/test_triton_compile.py
# in all six autotuner configs, about the fastrpe kernels of a `first`, pack into 4.2 MiB
# without intermediates (46 MiB raw; 8 s on 2 cores) and 13.7 MiB with them (270 MiB raw, 27 s);
# with Flex's, fla's and more constexpr variants a real run should come to 8-16 MiB without
# them (past 16 MiB the least valuable entries stay out). tests/test_compile_cache.py checks the
# round trip: a pruned pack unpacked elsewhere is a cache hit (triton 3.9, 3.7.1 and 3.6). A
# stale pack costs nothing but its unpacking: a changed kernel has another key.
#
# Precompiled on the CPU (2026-11-27, benchmarks/precompile.py): fastrpe's own kernels for every
# row the bench times, built here for the image (sm_90, triton 3.6.0 under Python 3.12) and
# carried as the first call's pack, so that the warm-up and the bench find them compiled. Before
# a session's first call, with the tree as it will be carried (a kernel's key hashes its source):
#   python3.12 -m venv /tmp/venv312 && /tmp/venv312/bin/pip install triton==3.6.0   # once; no torch
#   /tmp/venv312/bin/python benchmarks/precompile.py key > runs/precompile/triton_key_cp312.txt
#   (the image's torch and triton; once, about 3 GB: python3.11 -m venv /tmp/venv211 &&
#   /tmp/venv211/bin/pip install torch==2.11.0 triton==3.6.0 -e .)
#   PYTHONPATH=src /tmp/venv211/bin/python benchmarks/precompile.py record --out runs/precompile/specs.json
#   PYTHONPATH=src /tmp/venv211/bin/python benchmarks/precompile.py record --out runs/precompile/specs_1m.json \
#       --families alibi,kerple_log,kerple_power,t5 --lengths 1048576 --no-prf-sweep   # 8 minutes
#   PYTHONPATH=src /tmp/venv211/bin/python benchmarks/precompile.py compile --specs runs/precompile/specs*.json \
#       --triton-key-file runs/precompile/triton_key_cp312.txt --triton-dir runs/precompile/triton --jobs 2 \
#       --info .gpu_cache/precompiled.json
#   python3 benchmarks/compile_cache.py pack --triton-dir runs/precompile/triton \
#       --inductor-dir runs/precompile/inductor --out .gpu_cache/compile_cache.tar.xz --max-bytes 16711680
# The script's log prints whether the pack was built for the image's triton, and gpu_warm.json
# (each worker's `triton_compiles`) how many kernels came from the cache and which compiled.
# Compile into the folder you pack from: Triton's lookup files hold absolute paths, so a moved
# folder misses everything (only compile_cache.py's pack and unpack rewrite them). `verify`
# (PYTHONPATH=src /tmp/venv211/bin/python benchmarks/precompile.py verify --triton-key-file
# runs/precompile/triton_key_cp312.txt --triton-dir runs/precompile/triton) should say 0 compiled.
#
# New since the third CPU session of 2026-11-29 (no GPU), for the next to read first:
# - The causal FFT path takes each chunk's own pairs by triton_tiled (`fft.causal.LOCAL`, "cuda"
#   by default, untimed), not the recursion inside each chunk and its dense torch leaves, and
#   picks its chunks with them (`plan.local_levels`: one chunk, all tiled, up to 16k tokens). By
#   the byte count (benchmarks/results/fft_local_at_scale*.json, with the fused row sums below)
#   the bench's causal table call moves 578 -> 421 GiB at 64k, 4,158 -> 2,396 at 262k; with
#   the lag kernels 427-451 -> 281 and 2,250-2,539 -> 1,199-1,295 (>= 0.27 s at the H200's
#   peak, against about 2.1 s for Flex).
#   Read `fastrpe-fft` (and `auto`) against the new `fastrpe-fft+chunk-recursion` (the path
#   before) at 64k and 262k, and the lag kernels' row. If the recursion wins anywhere, set LOCAL
#   back or recalibrate `plan.LOCAL_PAIR_BYTES` (tf32x3's H100 rate of triton_tiled: the local
#   calls are bf16x3). The first call's tests run the blocked product at 4k with the tiled
#   chunks (`test_fft_blocked_product_*[tiled-*]`); the `fft` float64 tests at 4k run one chunk,
#   all tiled. The tiled kernel's float32-feature variants the FFT path launches are in the pack
#   (`precompile.py record` runs a local call).
# - The FFT products' row contractions after each inverse transform (`out += (a*b).sum(dim)`)
#   run in one Triton kernel (`fft/triton_rowsum.py`, `ROW_SUMS = "cuda"`, untimed), causal or
#   not: about 10% fewer bytes by the count. It is not in the pack (it compiles on the device,
#   one variant per layout, seconds); `+chunk-recursion` keeps it. If the FFT rows look slower
#   than their bytes, time `use_row_sums("never")` against it.
#
# New since the second CPU session of 2026-11-29 (no GPU):
# - `fastrpe-fft+lag-kernels` (fresh 64k window, causal table; and after the 262k pair): the
#   causal blocked product's sums over chunks in Triton kernels on the spectra as cuFFT writes
#   them (`fft/triton_blocked.py`, `fft.blocked.KERNEL`, opt-in), with the chunks the plan picks
#   for them (`plan.KERNEL_BLOCKED_LEVELS`: no lag matrices, so 64 chunks at 262k and 1M where the
#   torch path takes 8 and the recursion). By the byte count 595 -> 444-468 GiB at 64k, 4,240 ->
#   2,322-2,611 at 262k (>= 0.52 s at the H200's peak, against about 2.1 s estimated for Flex:
#   the causal 262k criterion's best row, though 4x would take the whole peak). Its kernels are
#   not in the compile pack (the pack covers `ops/triton_*` and `ops/linear/triton_*`): they
#   compile on the device (3 kernel variants, 4 with a table's gradient, x 3 configs: seconds
#   each). Its GPU test (`test_blocked_lag_kernels_match_the_torch_path_realistic`) runs last
#   among the first call's tests, so that its compilations take no other test's time.
#   If it wins, make KERNEL "cuda" the default and recalibrate `fft.plan`'s lag-matrix traffic.
# - the fused maps run in KERPLE's last launch group too (several groups: 262k and 1M), and the
#   1M window times `fastrpe-triton_soe+saved-states+stacked-states+fused-maps`, the likeliest
#   row of the 60 ms / 8 GiB criterion.
# - the not-causal table's near band sizes its blocks for the backward and adds each block's
#   gradients in place (`fft/segments.py`): 1M peak 27.7 -> 25.6 GiB in all, bytes -1.7%.
#
# New since the first CPU session of 2026-11-29 (no GPU), for the next to read first:
# - `gpu_prep.sh` builds the pack again when it no longer covers the library's kernels
#   (`precompile.py outdated`): a checkout may keep the last session's ignored folders.
# - KERPLE's and T5's "+fused-maps" rows (the PRF maps' backward inside the SoE gradient kernels,
#   `triton_soe_prf`, FUSED_MAPS) join the fresh 64k window: read them against fla's geometric
#   time beside the stacked-states rows; if they win, make FUSED_MAPS the default (and try it
#   with STATE_TERMS = 4: they change different kernels).
# - the causal table's FFT path adds each segment's gradients in place (CODE_EPOCH 12; by the
#   count of benchmarks/fft_at_scale.py 42% fewer bytes at 1M, 22% at 262k with the chunk model
#   recalibrated: 8 chunks on an H200, 5% at 64k) and the not-causal one runs its near band in
#   blocks of rows (1M peak 38.4 -> 27.7 GiB in all): read the 1M rows' peak_total_bytes against
#   40 GiB and fft_at_scale.json's 28.8 / 27.7 GiB.
#
# New since the seventh CPU session of 2026-11-28 (no GPU), for the next to read first:
# - the causal FFT path picks its chunks from a byte model that counts the blocked product's lag
#   matrices (`fft.plan.causal_chunk`, CODE_EPOCH 11), and on a GPU its default memory budget is
#   1/32 of the card, up to 4 GiB (`fft.plan.device_budget`; it was 512 MiB everywhere). With
#   the bench's 8 heads on an H200: 32 chunks at 64k as before, 16 at 262k, the recursion at 1M
#   (about 9 levels' worth of traffic where 64 chunks moved about 85). By the CPU byte count the
#   causal table at 64k moves 635 GiB in 2,599 ops (was 848 in 12,048; benchmarks/
#   fft_blocked_traffic.py, results/table_paths-learned-64k-h8*.json): at least 142 ms at the
#   H200's peak, so the "no slower than Flex" criterion there rests on `triton_tiled` (+bf16x3,
#   +bf16-features), as planned. Read the 1M learned rows' time and peak against 40 GiB.
#
# New since the sixth CPU session of 2026-11-28 (no GPU), for the next to read first:
# - a session's checkout now starts fresh: .fla_site, .gpu_cache, .gpu_runs and runs/ are gone.
#   `bash benchmarks/gpu_prep.sh` builds them again before the first call (the whole list below,
#   one command); `first` resumes the newest committed JSON of the GPU it runs on when
#   .gpu_runs/ holds none (`gpu.resume_source`): commit each session's gpu.json under
#   benchmarks/results/gpu/ (h200-DATE.json) so that the next H200 session goes on from it.
#
# New since the fifth CPU session of 2026-11-28 (no GPU), for the next to read first:
# - the causal FFT path on CUDA takes the pairs across chunks by one blocked product
#   (`fft.causal.BLOCKED` = "cuda", `fft/blocked.py`): one FFT per chunk of T positions and, per
#   frequency, a lower-triangular sum over earlier chunks (a batched complex matmul), instead of
#   log2(L/T) halving levels; inside each chunk the recursion as before. Causality stays bitwise.
#   By the CPU byte count (benchmarks/table_paths.py --causal-blocked, H = 1) it moves 38% fewer
#   bytes at 64k with half the launches. CODE_EPOCH 10 moves the causal table's `fft` and `auto`
#   rows. Read: the 1M window's `fastrpe-fft` on the causal table (time and peak against 40 GiB)
#   and, if `rest` reaches them, the 262k rows. Its GPU tests (`test_fft_blocked_product_*`,
#   `test_no_host_sync_in_the_fft_blocked_product`) run it at 4k in 16 chunks. To time the
#   recursion on the GPU, set BLOCKED = "never".
#
# New since the fourth CPU session of 2026-11-28 (no GPU), for the next to read first:
# - the workplace now lends H200s only (`status`: kinds ["nvidia-h200"]); on one, the H100's
#   JSON in .gpu_runs/ does not resume (another device), and `first` starts afresh. A fresh
#   `first` used to time every criterion's rows shortest length first, 64 rows at 4k before
#   any at 64k; now, after the tests, the warm-up and fla's rows, it takes two windows:
#   PRIORITY_FRESH at 64k (Flex, `auto` and each family's fastest rows of the H100, 31 rows),
#   then, if 110 s are left, PRIORITY_FRESH_SHORT at 4k (Flex and fastrpe with and without CUDA
#   graphs, 32; else `rest` runs them), and the
#   warm-up compiles those first (`--warm-first` patterns at a length, "flex@65536",
#   `gpu.row_matches`). Run it as before (same command; .gpu_runs/ may stay: it is ignored on
#   another GPU) and `rest` after: its 1M window (now KERPLE's bf16x3 row too), decoding and
#   the host-sync check, then the rest. The check's criteria are the H100's, read on an H200
#   (the same Hopper chip, 1.4x its memory bandwidth): say so beside every verdict;
# - KERPLE's "at most 2x fla" (6.33 / 7.36 ms against 5.44 on the H100): the chunk-state passes
#   with four terms' states a program (`triton_soe.STATE_TERMS`, opt-in, `triton_soe_stacked`;
#   24 programs, which the auto scan blocks), rows `fastrpe-triton_soe+saved-states+stacked-states`
#   and `+saved-states+bf16x3+stacked-states` in the 64k window: if the bf16x3 one beats
#   `+saved-states+bf16x3`, make STATE_TERMS = 4 the default (and read whether its blocked scan or a
#   sequential one pays: its GPU test runs both); its GPU test
#   `test_soe_gpu_realistic_size_bf16_stacked_states` checks it against float64 at 4k;
# - KERPLE at 1M (60 ms and 8 GiB): the stacked row there takes four terms a launch group
#   (`stacked_group`, past the 1 GiB budget): by the byte count 320 -> 132 GB for power; read its
#   time AND its peak (CPU estimate 9.2 GiB against the per-term 7.7, which the H100 measured as
#   4.6); a bf16x3 row now counts at 1M by its and its twin's 64k errors (`gpu._accuracy_row`);
# - CODE_EPOCH 9: triton_soe's dq kernel skips the far weights' gradient for frozen terms (`DWQ`,
#   fewer spills: results/soe_dq_ptxas-sm90.json); on an H100 KERPLE's and T5's rows move;
# - the pack: triton_soe's dq and dk/dv recompiled, the stacked passes added, the two kernels'
#   stale entries dropped (`verify` at 4k and 64k, six families: 318 hits, 0 compiled), 16.6 MB;
#   the carry 10.1 + 36.8 + 16.6 of the 67.1 MB;
#
# New since the third CPU session of 2026-11-28 (no GPU), for the next to read first:
# - ALiBi against fla (3.15 ms, fla 2.72; the maps' backward launches 0.62 of it): two levers,
#   both timed by this script's `first` before the learned tables (PRIORITY_LONG_FAMILIES now
#   starts with alibi). (1) The maps' backward computes φ again from x (640 MiB for the four
#   launches at 64k, was 768) and both passes hold fewer registers (the projection multiplies
#   bf16 x as stored: forward 6 programs an SM in tf32x3, was 4; backward 3 in bf16x3, was 2); the
#   PRF sweep (PRF_S=20) now feeds a query's backward the dφ attention gives it, so bf16x3
#   (0.771 ms against 0.925 last time, refused for a tie artefact) can be adopted, and picks
#   each pass's launch ("FWD/BWD", `triton_prf.BWD_LAUNCH`): read its `adopt:` line in
#   gpu_first.log and `prf_sweep` in gpu_profile.json; every row after it runs the pick.
#   (2) `fastrpe-triton_chunked+bf16x3+fused-maps` (`backends_triton.FUSED_MAPS`, opt-in): the
#   maps' backward inside triton_chunked's dq and dk/dv kernels (`triton_chunked_prf`), no dφ
#   written or read; its GPU test `test_fused_maps_match_float64_at_4096` runs with the first
#   tests. If that row beats `+bf16x3` and fla, make FUSED_MAPS the default;
# - CODE_EPOCH 8 (no row moves for it: `auto`'s move for epoch 7 and carry it);
# - the pack: the last one with the PRF kernels and triton_chunked's dq and dk/dv recompiled and
#   the fused kernels added (62 entries; `verify` at 4k and 64k compiled nothing for any family),
#   19.5 MB; the carry 66.1 of 67.1 MB.
# New since the seventh H100 session (2026-11-28), for the next to read first:
# - it ran `first` (418 s) and `rest` (299 s) at 347678a: 19 pass, 6 fail, 5 missing
#   (docs/RESULTS.md, "Seventh H100 session"); resume h100-2026-11-28.json (above; .gpu_runs/
#   holds it). Failing: ALiBi against fla (3.15 ms, fla 2.72: the PRF maps, 0.93 ms of it at
#   0.8-0.9 TB/s, are the lever), both KERPLEs against fla's 2x (6.33, 7.36 against 5.44), the
#   learned table at 64k (auto's tf32x3 triton_tiled 230 ms, Flex 130), KERPLE at 1M (155, 235);
#   missing: the learned tables' other 64k, 262k and 1M rows;
# - the 64k window now takes the learned tables first (PRIORITY_LONG_FAMILIES): read the
#   triton_tiled +bf16x3 / +bf16-features rows there against Flex's 130 ms; the 1M window
#   (PRIORITY_1M) times the FFT path on the learned tables instead of the walk (two criteria
#   missing: "1M completes within 40 GiB");
# - CODE_EPOCH 7 (gpu.CHANGED): bf16x3 is the library's products for 16-bit calls
#   (`backends_triton.FLOAT32_PRODUCTS`): the plain Triton rows keep tf32x3 by name, every
#   `fastrpe-auto` row moves to be timed again; the SoE walk's dq and dk/dv kernels hold their
#   state transposed with a 16-bit operand (its +walk+bf16x3 row broke the CUDA context, and
#   four of each warm-up's six workers with it: the Hopper miscompile of HOPPER_TRANS_NOTE),
#   that row moves; the walk itself lost to the stored states everywhere (235 / 186 ms at 1M
#   against 240 / 155): no more time on it. The fast-launch decode rows (an IndexError: the grid
#   had one or two dims, Triton's runner reads three) move, fixed;
# - the pack: the seventh session's returned one (`rest`'s, 630 entries) merged with the
#   CPU-built kernels and the walk's recompiled (72), 19.2 MB, everything without Triton's
#   intermediates (tree 9.5 + .fla_site 37.0 + pack 19.2 of the carry's 67.1 MB).
# New since the second CPU session of 2026-11-28 (no GPU), for the next to read first:
# - KERPLE at 1M (240 / 156 ms, 60 asked) ran a term per launch group (the stored states of one
#   term are 0.55 GB there): `triton_soe.FAR_FIELD = "walk"` (triton_soe_walk.py, opt-in) walks
#   blocks of chunks with 4 terms' states stacked in registers, every term in ceil(K/4) passes,
#   no K·N states. Rows `fastrpe-triton_soe+walk`, `+walk+bf16x3` (KERPLE 4k/64k/1M), first
#   in PRIORITY_1M (not in the 64k window: T5's and the learned tables' missing rows keep it;
#   at 64k the stored states run in one group and move fewer bytes); their kernels (8
#   warps, `WALK_WARPS`: at 4 warps they spilled, benchmarks/results/walk_ptxas-sm90.json) are in
#   the pack (`precompile.py record --only '*+walk*'` at 4k and 64k; G is not specialized on, so
#   1M takes the 64k binaries). Read the 1M rows first: if a walk row is under 60 ms, or faster
#   than `fastrpe-triton_soe` where the terms run in several groups, make "walk" the choice
#   there (`triton_soe.FAR_FIELD`, or an "auto" that walks when `terms_per_group` < K). The
#   byte count (benchmarks/soe_traffic.py) expects ~68 / 58 ms (log / power) if the walk runs at
#   the stored path's share of the peak: about the 60 asked; the forward keeps its carries for
#   the backward (`use_saved_states(-1)`: not); its GPU test
#   (test_walk_gpu_realistic_size_bf16) checks it against float64 at 4k;
# - the pack: the last one's 132 CPU-built entries that no bench row at 4k/64k hits (16k/262k
#   specializations; `precompile.py verify` with Triton's cache lookups logged) dropped for the
#   walk's 72; 20.6 MB, `verify` 298 hits, 0 compiled;
# New since the CPU session of 2026-11-28 (no GPU), for the next to read first:
# - CODE_EPOCH 6: the fused decoding step's host path is leaner (the q/k/v row passed whole,
#   `triton_recurrent.prf_*_token_packed`; the map's constants checked once, `PRFStep`; one
#   fingerprint a step; no nn.Module.__getattr__): 101 -> 59 us (band, SoE), 79 -> 49
#   (geometric) on the CPU (results/decode_ops.json). The decode rows move and are timed again
#   with the KV steps; the eager criterion (3.01x, needs 5x) is the one to read; the profile
#   in gpu_first.log (decode_ops.py --profile) says what is left of the step on that host. The
#   kernels and their line numbers are unchanged: the pack in .gpu_cache still holds them;
#   three new decode rows "..., fast launch" time `triton_recurrent.FAST_LAUNCH` (the kernel
#   launched through its compiled binary, skipping Triton's 19-29 us of per-launch binding on
#   the CPU), each checked bit for bit against the JIT's launch first (a row that differs is
#   skipped and says so): if they are the fastest and pass, FAST_LAUNCH can be the default;
# - the PRF maps (0.75 ms of a 64k call's 3.1-3.4 ms for ALiBi: a third of the H100's bandwidth)
#   can walk several row tiles a program (`triton_prf.TILES`, loads pipelined, "64:4:tf32x3:4");
#   the sweep (PRF_S, 20 s by default now, its binaries in the pack) times them first and its
#   pick, if any, serves every row after it: read `prf_sweep` in gpu_profile.json;
# - otherwise the plan below (fla, the 64k window, T5 and the learned tables) stands. The pack
#   is the sixth session's less the old PRF kernels, plus the new ones built here (precompile.py
#   compile on the patched runs/precompile/specs.json: TILES=1 added to the PRF specs, the
#   sweep's recorded again; `verify` found the PRF kernels in it), 20.0 MB.
#
# New since the sixth H100 session (2026-11-27, fourth GPU session of the day), for the next:
# - it resumed the fifth's JSON at 099ae5d (epoch 4) with the pack refreshed on the CPU for the
#   five changed `_soe_*` kernels (`precompile.py compile` into runs/precompile/triton, then
#   those entries merged into the fifth session's returned pack with the stale ones dropped:
#   unpack it with compile_cache.py, copy the new kernel folders in, pack again); `first` 396 s,
#   `rest` 375 s on the same warm machine. Both KERPLEs pass at 64k (22.8x, 29.3x Flex, one
#   run), the learned tables' 4k CUDA-graph pairings pass, ALiBi passes at 1M (34 ms): 16 pass,
#   3 fail, 11 missing; resume h100-2026-11-27d.json (above);
# - fla's rows never ran: a context-breaking fla row of the third session kept fla out
#   (gpu.lost_elsewhere); CODE_EPOCH 5 moves it (gpu.CHANGED, whose entries now name their
#   epoch), so fla's 75 s time chunk_simple_gla at 4k and 64k, pruned, for the first time
#   since the pruning: read its rows (and whether it faulted) first;
# - the 64k Flex rows are no longer anchors moved every session (that set a new Flex against an
#   older session's fastrpe rows); `gpu.unpaired` moves a problem's Flex and fastrpe rows when
#   its ratio's sides are from two machines or one is missing: on the sixth's JSON, ALiBi's (Flex
#   from the sixth, triton_chunked from the fifth) and T5's Flex (no fastrpe row beside it);
#   the 64k window (PRIORITY_LONG) then times ALiBi, T5 and the learned tables, and the 1M
#   window comes after it (its one row left is a known fail, with ~50 s of autotuning);
# - the learned tables at 64k need <= Flex's ~131 ms: `triton_tiled+bf16-features` took 0.557 ms
#   against tf32x3's 1.54 at 4k under CUDA graphs (2.8x), so it may pass there;
# - the GPU tests' log said "the process died" where the budget had stopped them (timeout's
#   exit 124): it says so now; the bf16x3 float64 test was not reached (17 passed first);
# - KERPLE's "at most 2x fla" at 64k needs about 6.7 ms if fla takes the issue's 3.33: the new
#   row `fastrpe-triton_soe+saved-states+bf16x3` (in the 64k window through '*+bf16x3'), and
#   16-bit rows now count against KERPLE's 1e-3 where their bf16 error is their twin's;
# - the autotuners try 4 warps only (1, 2, 3 stages: triton_chunked.TUNE_CONFIGS): of the 103
#   choices the JSON's rows record, 8 warps won once. Half the compilations per kernel variant
#   and half the timed configs at each new tuning key; the warm-up keeps six workers, two per
#   config (gpu_warm.WARM_WORKERS), so it should reach about twice the rows it did;
# - the pack left in .gpu_cache (this sandbox) is the union of the sixth session's two returned
#   packs and the CPU-built one, less the 8-warp variants of the autotuned kernels: everything
#   in 20.1 MB (fla's 251 kernels, Inductor's 360 files, 672 of fastrpe's), which the 64 MiB
#   carry holds beside .fla_site and the tree with about 1.4 MB to spare; if the tree grows
#   past that, pack it again smaller (compile_cache.py pack --max-bytes);
# - the fused decoding steps' host time is profiled after the GPU tests (decode_ops.py --profile,
#   in gpu_first.log): read it before cutting anything from the eager step;
# - KERPLE at 1M (156 ms power, 240 log; the criterion asks 60 ms "with a decaying term",
#   which ALiBi's 34 ms meets): per term a full state pass over the keys, forward and
#   backward; docs/RESULTS.md "Sixth H100 session".
#
# New since the fifth H100 session (2026-11-27, third GPU session of the day), for the next:
# - it resumed the fourth's JSON at 9ee46fd with the CPU-built pack (.gpu_cache, precompile.py:
#   103-121 hits per warm-up worker, 28-34 compiled, mostly Inductor's); ALiBi at 64k passed
#   (16.2x; 17.6x with bf16x3), the 4k CUDA-graph pairings of ALiBi and both KERPLEs passed;
#   its JSON, h100-2026-11-27c.json, was the one the sixth resumed;
# - bf16x3 in triton_soe/triton_band faulted (illegal address at 8 warps, 1 stage) or went
#   wrong (4 warps, 1 stage) in _soe_bwd_dq_kernel; that kernel now tunes bf16x3 over 2 and 3
#   stages only (triton_soe.SOE_DQ_BF16X3_NOTE): test_sixteen_bit_products_match_float64_at_4096
#   should pass now; benchmarks/gpu_config_diag.sh isolates a config if anything faults again;
# - fla's probe answered (its variants pass with fla's oversized tiles pruned): FLA_PROBE is
#   off by default, and fla's rows (FLA_S=75) now run before the priority windows (they got
#   46 s, less than their first call, last time; four criteria read them), then the 1M rows
#   (three criteria, never reached), then the 64k and 4k windows; the profile is off by
#   default (PROFILE_S=45 to run it): its 45 s go to those rows;
# - the FFT path's per-row einsums (cuBLAS gemv, 190 of the 555 ms of GPU time of the 64k
#   learned_full call) are broadcast products and one vector_norm now: its rows are worth
#   timing again (docs/RESULTS.md, "The FFT product's per-row contractions");
# - not reached: triton_soe's 64k rows (KERPLE-log's criterion read `auto`, which is exact
#   only and ran triton_tiled, 230 ms), the 1M rows, learned 64k/262k, T5 at 4k captured;
# - test_flex_compiles_nothing_per_decoding_step_and_once_for_all_offsets failed (its first
#   GPU run, under the config-0 suite; message lost to the timeout). `first`'s test step does
#   not select it: `python3 -m pytest -q -m gpu tests/test_gpu.py -k flex_compiles` (a minute).
#
# New since the CPU session of 2026-11-27 (sixth of the day; no GPU), for the next to read first:
# - triton_tiled reads each pair's weight from a per-call table `exp(b - top)` (one more launch a
#   call, `triton_tiled.exp_table`) instead of an exponential per pair, for every head whose
#   table spans at most 20 nats in float32 (the bench's learned tables do: N(0, 1) entries);
#   each row's factor `exp(top - m)` is one exponential per row. Per interior iteration under
#   the image's triton 3.6.0, bf16 features: dk/dv 738 -> 642 SASS instructions, dq 528 -> 367,
#   forward 654 -> 539 (tf32x3: -8/-16/-9%); the tf32x3 dk/dv kernel spills 760 B (was 992). Its rows
#   are timed again anyway (CODE_EPOCH 3); the learned criteria read `+bf16-features` first
#   (docs/RESULTS.md, "triton_tiled's weights from a table");
# - the PRF maps divide once per row and reduce over D once (tf32x3 at 4 warps, as launched:
#   forward 1,192 -> 1,064 SASS instructions, backward 2,392 -> 2,184; docs/RESULTS.md, "The PRF
#   maps per row"). Every fastrpe row runs them (0.75 ms of the 64k ALiBi call's 3.77, 2026-11-27);
#   PRF_S=30 would time them against the sweep's other launches, if the minutes allow;
#
# New since the CPU session of 2026-11-27 (fifth of the day; no GPU), read by none yet:
# - triton_tiled takes its interior tile pairs (1,023 in 1,024 of a 64k causal walk) without the
#   masks of a 64x64 tile (`_interior`): per iteration 6-8% fewer SASS instructions with tf32x3,
#   12-20% with bf16 features, under the image's triton 3.6.0 (benchmarks/tile_bodies.py;
#   docs/RESULTS.md "triton_tiled's interior tile pairs without masks"). Its rows at every length
#   are timed again anyway (CODE_EPOCH 3, never run on a GPU yet). The learned criteria (64k: 279
#   ms against Flex's 131; 4k: 1.79 ms of GPU time against 0.37) most likely turn on the
#   `+bf16-features` rows: read tests/test_gpu.py::test_sixteen_bit_products_match_float64_at_4096
#   first, then those rows beside the tf32x3 ones;
# - fla's rows: a lead for the illegal memory access of chunk_simple_gla (2026-11-26, -27). fla-core
#   0.6.0's chunk_fwd_kernel_o offers (BK, BV) = (128, 128), (64, 64), (32, 32) at 3 stages on
#   Hopper, and chunk_h's kernels 32 and 64; the bench's K = 32 features (V = 64) make the wider
#   tiles cover their dimension in one loop iteration, which fla's own #989 (after 0.6.0) found to
#   fault on H100 (Triton's pipelined block-pointer loads prefetch a tile past the tensor) and
#   pruned in its GLA backward. The bench now applies fla's rule to those three kernels
#   (gpu.prune_fla_oversized_tiles; rows record `fla_pruned`; FASTRPE_FLA_PRUNE=0 keeps fla's
#   own), and the probe runs the bench's variant pruned, then "simple_gla K=32 fla's tiles"
#   unpruned: if only the unpruned one faults, that was it. Fewer configs also compile faster
#   (the fourth session's probe was still compiling at 100 s);
#
# New since the CPU session of 2026-11-27 (fourth of the day; no GPU), for the next to read first:
# - the illegal memory accesses of the `+bf16x3` rows (triton_soe, triton_band, triton_tiled)
#   and, likely, the first session's float64 failures with bf16 features (triton_chunked,
#   triton_soe) have a cause: their key-tile gradient kernels fed `tl.dot` a transposed product
#   rounded to 16 bits, which Triton 3.4-3.7.0 miscompiles on Hopper (fla's issue #640; fixed
#   in 3.7.1; the image's torch 2.11 pins 3.6.0). The kernels now form those tiles directly
#   (triton_chunked.HOPPER_TRANS_NOTE); tests/test_triton_compile.py finds the pattern in no
#   kernel's sm_90 TTGIR. So "bf16x3" is no longer refused on CUDA, the bench has `+bf16x3` rows
#   again (4k and 64k in the priority calls), and gpu.CODE_EPOCH 3 times the bf16-features rows
#   again. Worth a look in the GPU tests: tests/test_gpu.py::test_sixteen_bit_products_match_
#   float64_at_4096 (both 16-bit modes, the four Triton backends); if they pass and the rows are
#   faster, FLOAT32_PRODUCTS = "bf16x3" may become the default. Counted on paper for
#   triton_tiled (forward and backward, one 64x64 tile pair, in bf16 tensor-core passes of
#   K = 32): 64 in tf32x3 as timed (279 ms at 64k against Flex's 131), 56 now (below), 30 in
#   bf16x3, 14 for Flex's bf16: bf16x3 may bring it about even, not past;
# - tf32x3 (the default) multiplies a float32 operand by a bf16 one (values, bf16 states, the
#   output gradient) in two tf32 products, not three: the bf16 operand is exact in tf32, so
#   Triton's third product was of its zero low half (triton_chunked._dot_tf32x2; sm_90 PTX: 16
#   wgmma for a 64x64x64 product, was 24; tests/test_triton_compile.py). Most of
#   triton_chunked's and triton_soe's products are of this kind: their 64k rows should gain
#   (ALiBi needs 3.69 ms for 15x, was 3.77);
# - sessions start from a fresh checkout, without the ignored .gpu_runs/, .fla_site/ and
#   .gpu_cache/: copy the JSON and run fla_site.sh again (below, "Before the first call"); the
#   fourth session's compile pack is gone, and most kernels changed since anyway (the two items
#   above), so the warm-up compiles them;
# - triton_tiled's causal forward and dq kernels take their query tiles heaviest first (a tile's
#   work grows with its index; at 4k, 512 programs are about two waves): its 4k rows are timed
#   again (CODE_EPOCH 3), the profile's `_tiled_*` times at 4k were 0.50 + 0.25 ms (fwd, dq);
#
# New since the CPU session after the fourth (2026-11-27, third session of the day; no GPU):
# - the 4k CUDA-graph pairings no longer compile anything: `flex+cudagraphs` captures the
#   compiled Flex call of the `flex` row and `fastrpe-triton_{chunked,soe,band,tiled}+cudagraphs`
#   their eager call (gpu.captured: three calls on a side stream, one captured, its replay timed),
#   in the bench's pass 0, first in PRIORITY_ONLY. GPU test: tests/test_bench_gpu.py::
#   test_captured_replay_gives_the_eager_calls_gradients. If a capture fails, the row says why
#   (a host sync or a device-sized allocation in the call: worth fixing, as a user capturing a
#   training step would hit it too). Beside them, captured twins that only a replay can favour:
#   `fastrpe-triton_{chunked,band,soe}+blocked-scan+cudagraphs` (at 4k the sequential state
#   passes were 0.17 of triton_chunked's 0.36 ms of GPU time: 64 steps in 8 programs) and
#   `fastrpe-triton_tiled+bf16-features+cudagraphs`; if a blocked twin wins, STATE_SCAN "auto"
#   could block under capture too;
# - the decaying terms' 1M rows (60 ms and 8 GiB) get a call of their own after the 4k one
#   (PRIORITY_1M, PRIORITY_1M_S=120), and at the start of `rest` if `first` left them;
# - the priority calls run only the rows the criteria read (`--passes 0,1`): before, their
#   `--only` patterns went on to every family's rows of those competitors (pass 2) while their
#   window lasted, `+compiled` ones (a compile each) included;
# - the SoE fit takes fewer terms: the rates' grid runs from W/4 to 0.75x the term's reach
#   (was W/16 to 4x) and every count from 6 to 16 is tried: the bench's KERPLE log takes 11 at
#   64k (was 16), its power 9 (was 12), within the same 1e-4 check (docs/RESULTS.md, "The rates'
#   grid"). At about 0.2 ms per term (16 vs 12 terms: 10.33 vs 9.47 ms), KERPLE-log's row should
#   come to about 9.3 ms (the 20x needs 9.2 against the third session's Flex): compare the
#   `+saved-states` rows. A new term count is a new autotuner key (the tuned kernels time their
#   configs once more). New criteria rows `fastrpe-triton_soe+saved-states+blocked-scan` (in
#   PRIORITY_LONG through '*-scan'): with 11 terms the sequential state pass is 88 programs
#   over 1,024 chunks; if the blocked twin is the faster, STATE_SCAN "auto"'s SM share
#   (AUTO_BLOCKED_SM_SHARE) should count it;
#
# New since the fourth session (CPU, 2026-11-27, second session of the day), for the next to read:
# - carry the fourth session's own pack (compiled on the H100: 1,199 kernels of triton 3.6.0 and
#   249 of fla's 3.7.1, 15.2 MiB) as .gpu_cache/compile_cache.tar.xz; the CPU-built pack below
#   missed every kernel (the image's triton_key() is not PyPI's cp312 wheel's: "ebc25a1b996d vs
#   bd4757a49ddb"), so it stays out (runs/precompile/). gpu_warm.json now records the image's
#   `triton_key`: `python3 -c "import json,sys; sys.stdout.write(json.load(open('gpu_warm.json'))
#   ['triton_key'])" > runs/precompile/triton_key_image.txt`, then `precompile.py compile
#   --triton-key-file runs/precompile/triton_key_image.txt` builds a pack that can hit;
# - PRF_S defaults to 0 (the sweep adopted 64:4:tf32x3, now triton_prf's default) and the
#   profile takes 45 s for three 64k cases (the FFT path's learned_full, KERPLE-log, ALiBi):
#   about 110 s more for the bench;
# - resuming measures again Flex at 64k (gpu.ANCHORS) and every fastrpe Triton row from 16k
#   (gpu.CHANGED, CODE_EPOCH 2), first (PRIORITY_LONG): each 64k ratio from one machine. Then
#   the 4k CUDA-graph pairings (PRIORITY_ONLY), which no session has reached;
# - no `+bf16x3` rows: a CUDA call refuses FLOAT32_PRODUCTS = "bf16x3" (illegal memory access
#   in triton_soe, triton_band and triton_tiled, 2026-11-27);
# - the FFT product's channels are channel-major now (every transform along the last axis; on
#   the CPU 1.5-1.9x the product): the profile's fastrpe-fft learned_full case and the
#   fastrpe-auto learned_full row at 64k (651 ms before) say what it did on the GPU.
#
# New since the third session (CPU, 2026-11-27, later), read by the fourth:
# - the precompiled pack (above): the log's "precompiled kernels" line and gpu_warm.json's
#   `triton_compiles` say whether the device found fastrpe's kernels compiled; if it did, the
#   warm-up ends early and the bench gets its minutes;
# - the PRF sweep runs before the priority rows and its pick, if any, is used from there on
#   ("PRF maps: the sweep's pick ..." in gpu_first.log; each run's `prf_launch` in gpu.json's
#   envs): compare the 64k ALiBi rows with the 15x criterion's 3.7 ms, then make the pick
#   triton_prf's default (BLOCK_ROWS, NUM_WARPS, PRECISION);
# - `+bf16x3` rows for every Triton backend (criteria rows): the float32 features multiplied by
#   bf16 halves (`backends_triton.FLOAT32_PRODUCTS`) instead of tf32x3, half the tensor-core
#   passes and fewer registers (ptxas, sm_90). If they beat their twins with `max_abs_err` no
#   worse than about the bf16 rounding, make "bf16x3" the default; the PRF sweep tries it too
#   (64:4:bf16x3, 128:8:bf16x3);
# - triton_tiled's `+bf16-features` and `+bf16x3` rows are criteria rows: the learned tables at
#   64k need <= Flex + table's 131 ms (triton_tiled was 282 with tf32x3 products).
#
# What the third H100 session (2026-11-27, docs/RESULTS.md "Third H100 session") taught, in two
# calls (430 s `first`, 301 s `rest`, 772 s of the 900 with the machine's start):
# - fla's chunk_simple_gla broke the CUDA context under triton 3.7.1 too; the probe's answer was
#   lost (`wait && tee`), now kept in gpu_tests.log whatever its exit;
# - flex+cudagraphs failed ("accessing tensor output of CUDAGraphs that has been overwritten"):
#   the timed backward accumulated into .grad across replays; each call now starts from none;
# - the profile (64k only: its 45 s went there) showed the state passes as the largest part of
#   every fastrpe call, and PRF maps at 0.37 ms per forward launch, 9x their traffic: now
#   benchmarks/prf_sweep.py times their launch choices (PRF_S=30, into gpu_profile.json);
# - "blocked" was host-bound (179 launches, ~30 ops for the carries): the carries are one
#   kernel now and STATE_SCAN "auto" blocks triton_chunked and triton_band from 16k tokens;
#   gpu.CHANGED makes the resumed `first` time those rows again, first (PRIORITY_ONLY);
# - the backward's second state pass was 1.25-1.28 ms of the soe and band calls at 64k:
#   triton_band (one term) now keeps its states, triton_soe on request (`+saved-states` rows);
# - the warm-up compiled about a third of its rows in 140 s: the compile cache (above).
#
# What the second H100 session (2026-11-26, docs/RESULTS.md "Second H100 session") taught:
# - fla-core 0.6.0's chunk_simple_gla breaks the CUDA context on this image (an illegal memory
#   access; torch 2.11, triton 3.6; fla-org/flash-linear-attention#734 reports fla kernels
#   crashing on H100 with triton 3.2-3.6): the bench now records that row, exits 75, and this
#   script resumes it in a new process without fla; the fla criteria stay unmeasured here;
# - compiled Flex with a table score_mod (T5, learned) asked for 245,760 B of shared memory
#   (H100: 232,448): the Flex baseline now tries 2 stages, then 64x64 tiles (`flex_tiles` in
#   its rows says which compiled), and fastrpe's `flex` backend uses the tiles for such terms;
# - every warm-up worker died at start (set_per_process_memory_fraction wants a device index
#   on torch 2.11), fixed; with them the warm-up reached 14-15 of 21-22 rows in 153 s;
# - a device call brings back 8 files: the warm-up's plan and logs stay on the machine;
# - new: gpu_profile.json (benchmarks/gpu_profile.py, PROFILE_S=65 s after the warm-up): each
#   Triton row's kernels at 4k and 64k and the GPU's busy share, to say whether the 4k rows
#   (1.8-3.8 ms vs Flex's 0.9-1.6) are host-bound and which kernels hold the 64k ones.
# - new, untimed: `fastrpe-triton_{chunked,soe,band}+blocked-scan` (triton_chunked.STATE_SCAN =
#   "blocked": the chunk-state passes in √N blocks side by side instead of one walk over 1,024
#   chunks in 32 programs at 64k, 96 for soe's 12 terms). Criteria rows for ALiBi (15x: 5.85 ms
#   must become 3.7), KERPLE (20x: 12.1 / 11.4 ms must become 9.2 / 11.1) and T5, and profile
#   cases; where it is the faster, make "blocked" the default on CUDA. GPU test:
#   tests/test_triton_chunked.py::test_gpu_realistic_size_bf16_blocked_scan.
# - new, untimed: `fastrpe-triton_{chunked,soe,band,tiled}+compiled` (the call under
#   torch.compile(fullgraph=True), as Flex runs; the kernels are custom ops in the graph) at
#   4k and 16k (--compiled-max-length), in a pass of their own after every eager criteria row
#   (compiling takes long); the 4k criteria read them. Check their first_call_seconds (the
#   compile), and that they beat their eager twins at 4k; GPU test:
#   tests/test_gpu.py::test_triton_backend_compiled_by_inductor_equals_eager (in `tests`).
#   If gpu_profile.json shows the compiled 4k call still mostly host time, run with
#   COMPILE_MODE=reduce-overhead (CUDA graphs for Flex and the +compiled rows alike; a fresh
#   JSON: the Flex baseline changes with the mode). gpu_profile.py profiles the compiled 4k
#   ALiBi call in both modes, last (PROFILE_S now 65): benchmarks/host_time.py found on the CPU
#   that compiling alone raised a call's host time (guards, AOT wrappers).
# - new: each fastrpe row records the autotuners' choices its calls made (`autotuned`: kernel ->
#   {tuning key: num_warps, num_stages}); configs that never win can leave TUNE_CONFIGS, and
#   the warm-up (153 s of the last session's 15 minutes) shrinks with them.
# - new (2026-11-27): under COMPILE_MODE=reduce-overhead a graph Inductor cannot capture runs
#   without CUDA graphs, and says so in one log line only; the +compiled and Flex rows (and
#   gpu_profile's cases) keep those lines (`cudagraph_skips`). None expected: the CPU tests find
#   no op Inductor refuses in the Triton backends' graphs (tests/test_compile.py), and the GPU
#   test test_gpu.py::test_triton_backend_compiled_with_cuda_graphs_* (in `tests`) checks the
#   capture and the replays against eager.
# - new (2026-11-27): in the default mode the bench also times Flex and the +compiled rows with
#   CUDA graphs (`flex+cudagraphs`, `fastrpe-*+compiled+cudagraphs`: mode="reduce-overhead", up to
#   --compiled-max-length), so one JSON answers the 4k question both ways; the 4k criteria pass
#   on either like-with-like pairing. COMPILE_MODE=reduce-overhead (a fresh JSON) is no longer
#   needed for it.
# - new (2026-11-27): SMOKE=1 runs this script's steps on a machine without a GPU (toy sizes);
#   run it after any change here, before a GPU session spends its minutes on a shell error.
#
# What the first H100 call (2026-11-23, docs/RESULTS.md "First contact with an H100") taught:
# - run `tests` first, in its own call: it fails fast where something is wrong, and with the
#   messages the next fix needs (a 250 s cap cut it at 95 % without any);
# - the first call of fla's chunk_linear_attn autotunes and compiles for more than 60 s: keep the
#   bench's default --call-cap-s 180 (a lower cap records it as over the cap, not as slow);
# - each decode row is also timed replayed as a CUDA graph (`graph_seconds`): the eager step is
#   launch-bound (1.9 ms for ~0.1 ms of work), so compare the graphed columns too.
#
# New since that call (CPU, 2026-11-24), for the next one to confirm:
# - `triton_band` (T5 / clipped tables, exact, the fused kernel with one undecayed term): the
#   t5 criteria at 64k should now have a Triton row; the GPU tests cover it through BACKENDS;
# - the fused kernel's near field spans several 64-token chunks (T5: 3) instead of one 128-token
#   chunk, whose float32-feature backward could not fit the H100's shared memory (ptxas, sm_90);
# - `triton_soe` runs its terms in groups of states that fit 1 GiB, and the composition around
#   the kernels holds less (PRF keeps only x and phi, bf16 values read as they are; 2026-11-25:
#   the Triton backends divide num/den inside their autograd functions and their backward reads
#   the bf16 output gradient, triton_chunked stores bf16 chunk states and runs dk/dv and dq as two
#   kernels, PRF's forward goes in blocks of positions): benchmarks/composition_memory.py
#   estimates the 1M rows from the CPU at 6.72 GiB (triton_chunked, ALiBi), 6.64 (triton_band, T5)
#   and 7.66 (triton_soe) above the inputs (was 28-29, then 10.1-10.8, then 7.7 / 7.7 / 9.6-9.9;
#   2026-11-25, second session: the quotient is freed before the kernels' backward,
#   `_QuotientGrad`, and the bench's call no longer holds its output through backward: 8.1 for
#   triton_soe; fourth session: its dv summed over term groups as bf16 pairs);
#   compare the 1M rows' peak_bytes with that estimate;
# - ptxas reports register spills in the float32-feature (tf32x3, the bf16 default) gradient
#   kernels and none with bf16 features (`FASTRPE_COMPILE_CHECK=1 python -m pytest -s
#   tests/test_triton_compile.py`; benchmarks/results/ptxas-sm90.json): triton_chunked's went
#   from 1.3 KB to 0.26 KB with the split, the fused kernel's are 0.8-2.6 KB (_soe_bwd_dq lost
#   one product per term and chunk: the far weights' gradient from do·Sᵀ); weigh the
#   `+bf16-features` rows' speed against their error before keeping LOWP_FEATURES = "float32";
# - (2026-11-25) the Triton backends' autograd functions return num/den themselves: the output
#   kernels write the bf16 quotient (DIVIDE, OUT_BF16), the backward kernels read the bf16 output
#   gradient and scale by 1/den after their products (SCALED), triton_chunked's gradient kernel is
#   _bwd_dkv then _bwd_dq; `tests` checks them against float64 through BACKENDS at L = 4,096;
#   the fastrpe rows at 64k should gain from the float32 num no longer written, scaled and cast;
# - (2026-11-25, second session) the sum-of-exponentials fit follows the term's reach and weighs
#   errors as the backend's check counts them: the bench's KERPLE power takes 12 exponentials at
#   64k instead of 32 (KERPLE log keeps 16), so its triton_soe rows should be about 2x faster
#   than the 32-term fit would have been; `_soe_bwd_dq` does one product fewer per term and chunk;
# - the `flex` backend now uses a causal BlockMask on CUDA (the bench's Flex rows always did);
# - a one-token decoding step launches 39-46 kernels instead of 64-104 (benchmarks/decode_ops.py,
#   counted on CPU): the decode rows' eager times should drop; the 5x criterion is open.
# - (2026-11-25, third session) on CUDA the ALiBi/NPRF decode step is the q/k/v matmul, one
#   Triton kernel (PRF features, state update, num/den: `prf_linear_token_triton`) and the
#   output projection: 5 launches instead of 39 (decode_ops.py). The decode section times the
#   same layer with the PyTorch ops too ("..., PyTorch ops", `FUSED_STEP = "never"`); each ALiBi
#   row says which ran (`fused_step`). If the fused row is not the faster one, set
#   `attention.FUSED_STEP` to "never" by default. The GPU test
#   `test_fused_step_at_the_bench_shape_on_cuda` compares the two at the bench's shape.
# - (2026-11-25, third session) on CUDA, PRF/NPRF features are one Triton launch forward and
#   one backward (`ops/triton_prf.py`, `kernels.TRITON_FEATURES = "cuda"`) instead of about 11
#   and 15 elementwise PyTorch ops per map, each reading or writing a float32 [B, H, L, D]
#   (128 MiB at 64k x 8 heads). Every fastrpe row is charged its feature maps (fla's are not),
#   so the fastrpe rows at 64k and beyond should drop by milliseconds. GPU tests:
#   tests/test_triton_prf.py::test_bench_shape_on_cuda. To compare with the PyTorch maps, set
#   `fastrpe.kernels.TRITON_FEATURES = "never"` in a run of its own.
# - (same session) a frozen term's SoE fit and log-coefficient table are kept per parameter
#   state: a Triton-backend call, forward+backward, launches 76 / 82 / 98 kernels (triton_chunked
#   ALiBi / triton_soe KERPLE-log / triton_band T5) instead of 138 / 215 / 178
#   (benchmarks/call_launches.py): the L = 4,096 rows, where launches dominate, should drop most.
# - (2026-11-25, fourth session) `triton_tiled`: any 1D table exactly in flash-style tiles
#   (quadratic time, linear memory). The learned-table criteria at 4k and 64k read it first, with
#   its `+bf16-features` twin; it is not run beyond --flex-max-length. From the CPU
#   (benchmarks/table_paths.py), the FFT path moves 18 GiB at 4k and 167 GiB at 16k, causal: it
#   cannot meet those criteria. The tiled kernels' flops at peak are 0.23 / 3.6 ms at 4k / 16k,
#   and 58 ms at 64k with float32 features (13 with bf16), against Flex + ALiBi's 51.8. Check
#   both twins at 64k; the GPU tests cover it through BACKENDS
#   (tests/test_triton_tiled.py::test_tiled_gpu_realistic_size_bf16 too).
# - (same session) `_dot` multiplies two operands that are both bf16 already (the output
#   gradient against bf16 values or bf16 chunk states) in one bf16 tensor-core pass instead of
#   three tf32: exact either way, and the backward kernels spill less (ptxas-sm90.json). The
#   GPU tests' float64 comparisons at L = 4,096 check it;
#   `triton_soe` carries dv over term groups as bf16 pairs (1M estimate 7.66 GiB); a frozen
#   term's kernel tables are kept, so a call launches 65 / 67 / 67 / 59 kernels (triton_chunked /
#   soe / band / tiled; call_launches.py, 18 of them the CPU-only input check).
# - (same session) the T5 band and KERPLE-log SoE decode steps are one Triton launch each too
#   (`prf_band_token_triton`, `prf_soe_token_triton`: 7 launches a step instead of 46 / 45,
#   decode_ops.py). The decode section times each constant-size row twice, fused and "PyTorch
#   ops"; compare the pairs (eager and graphed) as for ALiBi. GPU tests:
#   tests/test_triton_recurrent.py -k on_cuda.
# - (2026-11-26) the compile warm-up (above). Every kernel also compiles for sm_90 under triton
#   3.6.0, the image's version (all other checks used 3.9.0): the compile check in a venv with
#   triton==3.6.0, benchmarks/results/ptxas-sm90-triton3.6.json; tests/test_gpu_warm.py (the
#   one-config autotuner premise included) passes there too. Each timed row now records
#   first_call_seconds: near its warm time where the warm-up's cache was hit.
# - (same day) the whole suite on CPU under torch 2.11.0 + triton 3.6.0 (the image's versions,
#   Python 3.11): 3,333 passed, 370 skipped, 165 failed, every failure triton 3.6's interpreter
#   with numpy 2.4 ("only 0-dimensional arrays can be converted to Python scalars" at a
#   `range(N)` over a kernel argument), which the GPU does not run. It also found a real one,
#   fixed: torch 2.11's Dynamo refused to trace the Triton backends' `find_spec("triton")`,
#   so every fullgraph compile through `auto` failed on 2.11.
# - (2026-11-26, later) fastrpe's `flex` backend compiles once per shape and term, not once per
#   query offset (the offset is a tensor in the compiled path), runs eager FlexAttention below
#   128 queries (a decoding step, a new key length each call, compiled at every step before), and
#   raises Dynamo's recompile limit for its own calls (the ninth shape fell back to eager Flex,
#   which materializes the scores). Its causal BlockMask is built from the block indices, the
#   same blocks as create_block_mask's (tests/test_flex.py), with nothing compiled; the bench's
#   Flex competitor still uses create_block_mask, as a user would. GPU test:
#   test_gpu.py::test_flex_compiles_nothing_per_decoding_step_and_once_for_all_offsets (`tests`).
# - (same session) the FFT path no longer queries its pending NaN-row events while a CUDA graph
#   is captured (an event query there invalidates the capture; it did after any earlier eager
#   call on the GPU). GPU test: test_gpu.py::test_forward_replays_as_a_cuda_graph, every
#   linear-time and FFT backend's forward captured and replayed against eager (`tests`).
# - (same session) `auto` on CUDA: a candidate whose first call compiles is timed by its next
#   calls (the compile time was taken for its speed, and the pick is cached on disk); under
#   capture or sync watching the bucket's earlier timings still decide (it ran the model's pick).
#   The Triton launches run on their tensors' device (Triton uses the current one), B·H over
#   65,535 is refused, and the PRF kernel's row offsets are int64 (E = 4,096 at 1M overflowed).
# - (same session) `soe` / `triton_soe` with a term in training on a GPU read the fit's verdict on
#   the host once, not at every optimizer step (each step is a new parameter state): the term
#   count is kept and each call's fit is checked on the device, its flag read at a later call
#   (a failed check warns and the next call fits again). GPU test:
#   test_gpu.py::test_no_host_sync_in_a_training_step_with_a_trainable_term (`tests`).
# - (2026-11-26, evening) the `fft` rows (learned tables) at 64k and beyond, two changes: its
#   fixed exact-row recompute stops growing at 626 rows per head (F = 32, Dv = 64) instead of
#   one row in 128 (O(L²): 27 % of the non-causal call's bytes at 262k; results/
#   fft_recompute.json); on CUDA each product of the causal recursion sizes its feature blocks
#   from its own segment (`fft.causal.SEGMENT_BLOCKS`): a causal call at 64k, B·H = 8,
#   launched 171,529 ops with blocks sized for the whole length, 21,241 now (results/
#   table_paths-segment-*.json). Its bytes at the HBM peak still put the causal 262k row far
#   from the >= 4x criterion (docs/RESULTS.md, "The FFT path at 64k and 256k"); compare the
#   rows' times with those bounds. To see the old blocks on the GPU, set SEGMENT_BLOCKS =
#   "never" in a run of its own. A trainable soe term's far-sample distances now go to the
#   device once per length, not at every step.
#
# `auto` on the GPU (issue 12 item 3): phase `auto` runs benchmarks/auto_cpu_check.py --device cuda
# (the cost model's pick vs the measured fastest exact backend, forward and forward+backward;
# writes $OUT/auto_check_fwd.json, auto_check_grad.json) and then the bench `--check`. `auto`'s
# default policy on CUDA is "measure" (fastrpe.set_auto_policy): the 1.2x rule must hold for the
# bench's "auto" rows; a worst ratio > 1.2 in auto_check_*.json says the GPU cost model needs work.
#   run(command="bash benchmarks/gpu_run.sh auto", carry=[".gpu_runs"], timeout_s=600)
set -uo pipefail

phase="${1:-short}"
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-runs/gpu}"
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

# The compile caches (benchmarks/compile_cache.py, "The compile cache" above): every process
# below, fla's and the tests' included, compiles into these fixed folders (with TRITON_CACHE_DIR
# set, Inductor keeps its Triton kernels there too), and a carried pack is unpacked into them
# first. A warm machine's second call keeps what its first compiled. SMOKE starts from an empty
# folder of its own. COMPILE_CACHE names another pack to unpack.
CC_ROOT=${COMPILE_CACHE_ROOT:-/tmp/fastrpe_compile_cache}
if [ -n "${SMOKE:-}" ] && [ -z "${COMPILE_CACHE_ROOT:-}" ]; then
    CC_ROOT=/tmp/fastrpe_compile_cache_smoke
    rm -rf "$CC_ROOT"
fi
export TRITON_CACHE_DIR="$CC_ROOT/triton" TORCHINDUCTOR_CACHE_DIR="$CC_ROOT/inductor"
mkdir -p "$TRITON_CACHE_DIR" "$TORCHINDUCTOR_CACHE_DIR"
CC_FILE=compile_cache.tar.xz
CC_SINCE=$(date +%s)  # what a process reads or writes from now on counts as used by this session
# this tree as it came (what the next call carries again, less the old pack): the pack's room
CARRIED=$(du -sb --exclude=./.git --exclude=./.gpu_cache --exclude=__pycache__ --exclude=./runs . | cut -f1)
python3 benchmarks/compile_cache.py unpack "${COMPILE_CACHE:-.gpu_cache/$CC_FILE}" \
    --triton-dir "$TRITON_CACHE_DIR" --inductor-dir "$TORCHINDUCTOR_CACHE_DIR"
# a pack of fastrpe's kernels built on a CPU machine (benchmarks/precompile.py): whether it was
# built for this image's triton (its entries hit only then; the warm-up log counts the hits)
[ -f .gpu_cache/precompiled.json ] && python3 benchmarks/precompile.py key-hash --expect .gpu_cache/precompiled.json
rm -f /tmp/fla_warm.log /tmp/fla_probe.log /tmp/gpu_warm_first.log /tmp/gpu_warm_rest.log /tmp/prf_sweep.json  # a warm machine's last call's

if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
else
    echo "no .whl/: fla is absent, its rows will say so"
fi

FASTRPE=(python3 -c 'import sys; from fastrpe.cli.main import main; sys.exit(main(sys.argv[1:]))')
fastrpe() { "${FASTRPE[@]}" "$@"; }

# SMOKE=1: every step on a machine without a GPU, at toy sizes (the bench's --smoke; the GPU
# tests skip): it checks this script before a GPU session spends minutes on it, and measures
# nothing (`OUT=/tmp/smoke SMOKE=1 FIRST_S=240 bash benchmarks/gpu_run.sh first`)
SMOKE_ARGS=()
LENGTHS=4096,65536,262144,1048576
FLA_LENGTHS=4096,65536
PRIORITY_LENGTHS=4096
# the 4k criteria's CUDA-graph pairings (both sides with graphs; eager, fastrpe's 4k rows are
# 10-40% GPU busy: host time), never reached in four sessions: first (the bench's pass 0) Flex's
# compiled call and fastrpe's eager one captured and replayed (gpu.captured: nothing compiled
# that the 4k rows have not), then +compiled, with and without mode="reduce-overhead"
# (and the `+bf16x3` rows: float32 features by bf16 halves, stopped by a Triton miscompile in
# 2026-11-27's session that the kernels no longer give it)
PRIORITY_ONLY='flex+cudagraphs,fastrpe-triton_*+cudagraphs,*+bf16x3,*+compiled'
# first, in a call of their own, the 64k rows of the ratio criteria, both sides on this machine:
# Flex (gpu.ANCHORS) and every fastrpe Triton row (gpu.CHANGED, epoch 2: the PRF products'
# default), the rows the 15x and 20x criteria read (2026-11-27: ALiBi 14.65x, KERPLE-log 17.9x
# against the third session's Flex); within one call the bench runs the shortest length first
PRIORITY_LONG='flex,*-scan,*+saved-states,fastrpe-triton_chunked,fastrpe-triton_soe,fastrpe-triton_band,fastrpe-auto,fastrpe-triton_tiled,fastrpe-triton_tiled+bf16-features,*+bf16x3,*+fused-maps,*+stacked-states'
PRIORITY_LONG_LENGTHS=65536
# the window's families in this order (the bench runs a length's problems in --families' order):
# the learned tables first, whose 64k rows no window has reached in seven sessions (2026-11-28:
# `auto`'s tf32x3 triton_tiled 230 ms against Flex's 130; its bf16x3 and bf16-features rows, 2-3x
# faster at 4k under CUDA graphs, never timed at 64k); since the third CPU session of 2026-11-28
# ALiBi before them: its resumed rows stand, and what it adds is seconds, `auto` (bf16x3 since
# epoch 7, the PRF backward of epoch 8) and the fused maps' row (`+fused-maps`), the likeliest
# pass of the "no slower than fla" criterion (3.15 ms against 2.72 last time)
PRIORITY_LONG_FAMILIES=alibi,learned,learned_full,kerple_log,kerple_power,t5
# then the 1M rows of the decaying terms (forward+backward within 60 ms and 8 GiB), which no
# session reached (the general pass runs the learned tables' 262k rows, seconds per call, first):
# their kernels are the 64k rows' (nothing to compile), a few seconds each
# (the walk's rows left out since the seventh session: it lost to the stored states at every
# length); and the FFT path's rows of the learned tables at 1M, whose criterion ("completes within
# 40 GiB", exact) no session has reached: its memory is bounded (a 512 MiB block budget,
# fft/plan.py), its time unknown there (64k: 0.57 s not causal, 1.2 s causal; each call capped
# at 90 s)
# (KERPLE's: the states kept, tf32x3 as timed before and bf16x3, the library's products for
# bf16 calls since epoch 7 and 5-20% faster at 64k, and stacked four terms a state program, four a
# launch group where the 1 GiB budget holds one (`triton_soe_stacked.stacked_group`; by the byte
# count 320 -> 132 GB for power's call, results/soe_traffic.json; its memory, CPU estimate, 9.2
# GiB where the per-term groups' is 7.7, which the H100 measured as 4.6: results/
# composition_memory-stacked4.json). A bf16x3 row counts at 1M by its and its twin's errors at
# 64k (`gpu._accuracy_row`). The plain row, as fast as the kept states' at 1M on the H100 and 57 s
# of autotuning in its first call, is left to the general pass)
PRIORITY_1M='fastrpe-triton_chunked,fastrpe-triton_soe+saved-states+bf16x3,fastrpe-triton_soe+saved-states,fastrpe-triton_soe+saved-states+bf16x3+stacked-states,fastrpe-triton_soe+saved-states+stacked-states+fused-maps,fastrpe-fft'
# the table over all offsets first (not causal: no recursion over blocks, the likelier to finish
# a call within the 90-s cap; CPU estimate at 1M: 4.8 TFLOP a forward, 18.7 GiB, `plan.estimate_fft_cost`)
PRIORITY_1M_FAMILIES=learned_full,learned,alibi,kerple_log,kerple_power
PRIORITY_1M_LENGTHS=1048576
# `rest` then times the learned tables at 262,144 (">= 4x faster than Flex", never reached by
# any session: the general pass takes the 4k rows first), Flex and the FFT path, for at most
# PRIORITY_262K_S s (default 120); Flex there is quadratic, about 2 s a call on the H100
# (130 ms at 64k), so each row is timed once past the bench's 2-s limit
PRIORITY_262K='flex,fastrpe-fft,fastrpe-auto,fastrpe-fft+lag-kernels:learned,fastrpe-fft+chunk-recursion:learned'
PRIORITY_262K_FAMILIES=learned,learned_full
PRIORITY_262K_LENGTHS=262144
# A fresh `first` (no JSON of this GPU to resume: since 2026-11-28 the workplace lends H200s
# only, and the H100's JSON does not resume on one): the fewest rows that decide each ratio
# criterion at 64k, both sides, in one window before anything else (fla's rows go before it,
# as when resuming): Flex, `auto`, and each family's fastest rows on the H100 (bf16x3 products,
# the fused maps, KERPLE's kept states, the tables' bf16 features); then, in a second window,
# the 4k criteria's rows, Flex's and fastrpe's calls replayed from CUDA graphs, where the H100
# passed all six. `rest` then takes the 1M rows, decoding, the host-sync check and the others.
# Their kernels are compiled first (`--warm-first` with "@L": at those lengths only).
# (KERPLE's bf16x3 rows count only beside their tf32x3 twins, `gpu.precision_twin`: both go;
# and the stacked state passes, `triton_soe.STATE_TERMS`, the KERPLE criteria's likeliest pass;
# and the FFT path on the learned tables alone, "competitor:family": the 64k criterion of the
# table over all offsets has no row yet, and the FFT is the exact linear-time candidate at 262k)
PRIORITY_FRESH='flex,fastrpe-auto,fastrpe-triton_chunked+bf16x3,fastrpe-triton_chunked+bf16x3+fused-maps,fastrpe-triton_soe,fastrpe-triton_soe+bf16x3,fastrpe-triton_soe+saved-states,fastrpe-triton_soe+saved-states+bf16x3,fastrpe-triton_soe+saved-states+stacked-states,fastrpe-triton_soe+saved-states+bf16x3+stacked-states,fastrpe-triton_soe+saved-states+fused-maps,fastrpe-triton_soe+saved-states+bf16x3+fused-maps,fastrpe-triton_band+bf16x3,fastrpe-triton_band+bf16x3+fused-maps,fastrpe-triton_tiled+bf16x3,fastrpe-triton_tiled+bf16-features,fastrpe-fft:learned*,fastrpe-fft+lag-kernels:learned,fastrpe-fft+chunk-recursion:learned'
PRIORITY_FRESH_FAMILIES=alibi,kerple_log,kerple_power,t5,learned,learned_full
PRIORITY_FRESH_SHORT='flex,flex+cudagraphs,fastrpe-triton_*+cudagraphs,fastrpe-auto'
PRIORITY_FRESH_SHORT_LENGTH=4096
PRF_ARGS=()
# the profile (PROFILE_S, 45 s): where the 64k time goes in the rows still short of their
# criteria: the FFT path for a learned table over all offsets (651 ms, six criteria), KERPLE-log
# (10.3 ms against 9.2) and ALiBi (3.77 ms against 3.69); the 4k rows' share is known (14-44%)
PROFILE_ARGS=(--lengths 65536 --cases fastrpe-fft:learned_full,fastrpe-triton_soe+saved-states:kerple_log,fastrpe-triton_chunked:alibi)
if [ -n "${SMOKE:-}" ]; then
    SMOKE_ARGS=(--smoke)
    LENGTHS=48,96
    FLA_LENGTHS=48
    PRIORITY_LENGTHS=48,96
    PRIORITY_LONG_LENGTHS=96
    PRIORITY_1M_LENGTHS=96
    PRIORITY_262K_LENGTHS=96
    PRIORITY_FRESH_SHORT_LENGTH=48
    PROFILE_ARGS=(--device cpu --lengths 64 --cases fastrpe-chunked:alibi)
    PRF_ARGS=(--device cpu --lengths 20 --configs 16:4:ieee,32:2:tf32x3)
fi

# fla in processes of its own (benchmarks/fla_site.sh): .fla_site/site.tar.xz holds fla-core
# and a trimmed triton 3.7.1, first on the path of the processes that warm and time fla's rows
# (FLA_ENV), with the image's ptxas; every other process keeps the image's triton and leaves
# fla's rows to them (SKIP_FLA). Without it, fla (if .whl/ has it) runs in the bench's process.
# (FLA_SITE names another pack: SMOKE runs here take one built for this machine's Python.)
FLA_ENV=()
SKIP_FLA=()
# the bench's --skip (one flag: its patterns comma-separated): fla's rows where its processes
# time them, and the 16-bit modes whose float64 test failed in this session (FAULTY, read from
# `first`'s junit XML each time this is called)
SKIP_ROWS=()
skip_rows() {
    FAULTY=$(python3 "${BENCH_DIR:-benchmarks}/gpu_tests_xml.py" --faulty-rows /tmp/gpu_tests.xml)
    local pats=()
    [ "${#SKIP_FLA[@]}" -gt 0 ] && pats+=("${SKIP_FLA[1]}")
    [ -n "${FAULTY:-}" ] && pats+=("$FAULTY")
    SKIP_ROWS=()
    [ "${#pats[@]}" -gt 0 ] && SKIP_ROWS=(--skip "$(IFS=,; echo "${pats[*]}")")
    return 0
}
FLA_SITE=${FLA_SITE:-.fla_site/site.tar.xz}
if [ -f "$FLA_SITE" ]; then
    rm -rf /tmp/fla_site && mkdir -p /tmp/fla_site
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' \
        "$FLA_SITE" /tmp/fla_site || exit 1
    cp -r "$(python3 -c 'import os, triton; print(os.path.dirname(triton.__file__))')/backends/nvidia/bin" \
        /tmp/fla_site/triton/backends/nvidia/ || exit 1
    FLA_ENV=(PYTHONPATH="/tmp/fla_site:$PYTHONPATH" TRITON_BACKENDS_IN_TREE=1)
    SKIP_FLA=(--skip 'fla-*')
    echo "fla's processes: $(cat /tmp/fla_site/FLA_SITE.txt)"
    env "${FLA_ENV[@]}" python3 -c 'import triton, fla; print("  importable: triton", triton.__version__, "fla", fla.__version__)'
fi
# (`rest` on the machine `first` ran on finds first's test results in /tmp)
skip_rows

# bench_until END LOG ARGS...: the bench over the criteria's lengths, rows then decoding then
# host syncs, ending END s after this script started: no new row once its budget is spent, a
# minute before the hard stop (a row's calls are capped at 90 s each; gpu.json is written after
# every row, so a row cut by the hard stop is all that is lost); 25 s kept for the kill's grace
# and --check.
# A row that breaks the CUDA context (fla's kernels did, 2026-11-26) ends the bench with exit 75
# after saving that row: it is started again with --resume, in a new process, while 80 s remain.
bench_until() {
    local end="$1" log="$2" left rc=75; shift 2
    local args=("$@")
    while [ "$rc" = 75 ]; do
        left=$(( end - SECONDS - 25 ))
        [ "$left" -gt 80 ] || { echo "no time left to resume the bench"; break; }
        echo "${SECONDS} s used, the bench gets ${left} s (no new row after $(( left - 60 )) s)" | tee -a "$OUT_DIR/$log"
        timeout -s INT -k 10 "$left" "${FASTRPE[@]}" bench --suite gpu "${SMOKE_ARGS[@]}" --lengths "$LENGTHS" \
            --sections "$SECTIONS" --budget-s "$(( left - 60 ))" --call-cap-s 90 --compile-mode "$COMPILE_MODE" \
            --out "$OUT_DIR" "${SKIP_ROWS[@]}" "${args[@]}" \
            2>&1 | tee -a "$OUT_DIR/$log"
        rc=${PIPESTATUS[0]}
        # a restart resumes this run: nothing retried again (its errors are this code's)
        local a next=(--resume)
        for a in "${args[@]}"; do [ "$a" = --resume ] || [ "$a" = --retry-errors ] || next+=("$a"); done
        args=("${next[@]}")
    done
}

# at_length PATTERNS L: each of the comma-separated competitor PATTERNS at length L only
# ("flex,fastrpe-auto" 65536 -> "flex@65536,fastrpe-auto@65536", for --warm-first); no glob
# expansion of the patterns' stars
at_length() {
    local pats=() i
    IFS=, read -ra pats <<< "$1"
    for i in "${!pats[@]}"; do pats[i]="${pats[i]}@$2"; done
    (IFS=,; echo "${pats[*]}")
}

# rows_1m END LOG: the 1M rows of the decaying terms and of the learned tables' FFT path
# (PRIORITY_1M, in PRIORITY_1M_FAMILIES' order), those a resumed JSON lacks, until
# END: in `first` after the 4k and 64k priority rows, in `rest` first (if `first` left them)
rows_1m() {
    bench_until "$1" "$2" --resume --sections rows --passes 0,1 --lengths "$PRIORITY_1M_LENGTHS" --only "$PRIORITY_1M" \
        --families "$PRIORITY_1M_FAMILIES"
}

# warm_until END PASS: compile what the bench's PASS (first|rest) runs, one process per Triton
# autotuner config side by side (fastrpe.bench.gpu_warm), ending END s after this script
# started; it times nothing, and the bench starts only after it (gpu_warm.json: what each
# process compiled, in how many seconds).
warm_until() {
    local left=$(( $1 - SECONDS ))
    [ "$left" -gt 20 ] || return 0
    timeout -s INT -k 10 "$left" "${FASTRPE[@]}" bench --suite gpu "${SMOKE_ARGS[@]}" --warm "$2" --lengths "$LENGTHS" \
        --budget-s "$(( left - 10 ))" --compile-mode "$COMPILE_MODE" --out "$OUT_DIR" "${SKIP_FLA[@]}" "${@:3}" \
        > "/tmp/gpu_warm_$2.log" 2>&1
}

# keep_log FILE LOG TITLE [LINES]: FILE (a log written outside $OUT_DIR) appended to the
# returned $OUT_DIR/LOG under a title line, whole or its last LINES lines, and its last 12
# lines printed (a device call brings back 8 files, and the end of its stdout only).
keep_log() {
    [ -f "$1" ] || return 0
    {
        echo "---- $3 ($1$([ -n "${4:-}" ] && echo ", its last $4 lines")) ----"
        if [ -n "${4:-}" ]; then tail -n "$4" "$1"; else cat "$1"; fi
        echo "---- end of $1 ----"
    } >> "$OUT_DIR/$2"
    tail -12 "$1"
}

# gpu_tests SECONDS LOG XML PYTEST_ARGS...: `python3 -m pytest PYTEST_ARGS` resumably, for at
# most SECONDS, its output into LOG (and the last 60 lines printed), its junit XML into XML. A
# test that breaks the CUDA context (an illegal memory access) stops its process after it
# (tests/conftest.py, FASTRPE_TESTS_DONE) and a new process runs the tests not finished yet,
# up to 6 processes: on the H100 of 2026-11-27 the third of 57 tests faulted, and the 54 after
# it failed with its error, saying nothing of their own kernels. A process that dies inside a
# test (the list's last line "# running <test>": no teardown recorded) counts that test as done
# and goes on the same way. SIGINT at the time limit: pytest still prints every failure so
# far. Returns the last process's exit status.
# (BENCH_DIR: where gpu_tests_xml.py is, for tests/test_resumable_tests.py, which runs this
# function alone.)
gpu_tests() {
    local until=$(( SECONDS + $1 )) log=$2 xml=$3 try=0 left rc=0 stops parts
    shift 3
    parts=$(mktemp -d /tmp/gpu_tests.XXXXXX)  # the list of finished tests, a junit XML per process
    : > "$log"
    while [ "$try" -lt 6 ]; do
        try=$(( try + 1 ))
        left=$(( until - SECONDS ))
        if [ "$left" -lt 15 ]; then
            echo "GPU tests: no time left for process $try" | tee -a "$log"
            break
        fi
        touch "$parts/done"
        stops=$(grep -c '^# stopped' "$parts/done")
        FASTRPE_TESTS_DONE="$parts/done" timeout -s INT -k 10 "$left" python3 -m pytest "$@" \
            --junitxml="$parts/$try.xml" 2>&1 | tee -a "$log" | tail -60
        rc=${PIPESTATUS[0]}
        # a test left running: the process died in it, unless the budget stopped it (pytest's 2 for
        # the interrupt, or timeout's 124: on 2026-11-27 a budget stop read "the process died")
        local last running=
        last=$(tail -n 1 "$parts/done")
        [ "${last#\# running }" != "$last" ] && running=${last#\# running }
        if [ -n "$running" ] && { [ "$rc" -eq 2 ] || [ "$rc" -eq 124 ]; }; then
            echo "GPU tests: the budget stopped them in $running" | tee -a "$log"
        elif [ -n "$running" ]; then
            printf '%s\n# stopped: the process died in %s\n' "$running" "$running" >> "$parts/done"
        fi
        [ "$(grep -c '^# stopped' "$parts/done")" -gt "$stops" ] || break
        echo "GPU tests: $(grep '^# stopped' "$parts/done" | tail -n 1 | cut -c3-); process $(( try + 1 )) runs the rest" \
            | tee -a "$log"
    done
    python3 "${BENCH_DIR:-benchmarks}/gpu_tests_xml.py" "$xml" "$parts"/[0-9]*.xml
    rm -rf "$parts"
    return "$rc"
}

# pack_cache END LOG: the compile caches into $OUT_DIR/$CC_FILE (benchmarks/compile_cache.py),
# ending END s after the start. The file stays under 16 MiB (the most a device call brings back)
# and under what the 64 MiB carry leaves next time beside this tree as it came (2 MiB kept for
# gpu.json's growth): everything if it fits, else without Triton's intermediate stages, else
# the entries this session used first. CACHE_MAX_BYTES overrides the bound.
pack_cache() {
    local left=$(( $1 - SECONDS )) max=$(( 16 * 1048576 - 65536 ))
    local room=$(( 64 * 1048576 - CARRIED - 2 * 1048576 ))
    [ "$room" -lt "$max" ] && max=$room
    max=${CACHE_MAX_BYTES:-$max}
    if [ "$left" -lt 8 ]; then
        echo "compile cache: ${left} s left, not packed" | tee -a "$OUT_DIR/$2"
        return 0
    fi
    if [ -n "${SMOKE:-}" ]; then  # a CPU compiles nothing else: one real Triton entry (sm_90) to pack;
        # `rest` unpacking `first`'s pack (COMPILE_CACHE=<first's OUT>/compile_cache.tar.xz) finds it: "hit": true
        echo "toy kernel for sm_90: $(python3 benchmarks/compile_cache_toy.py 2>&1 | tail -1)" | tee -a "$OUT_DIR/$2"
    fi
    echo "${SECONDS} s used, packing the compile caches ($(du -sh "$CC_ROOT" | cut -f1)) in ${left} s at most," \
        "into at most $(( max / 1024 )) KiB" | tee -a "$OUT_DIR/$2"
    timeout -k 3 "$left" python3 benchmarks/compile_cache.py pack --triton-dir "$TRITON_CACHE_DIR" \
        --inductor-dir "$TORCHINDUCTOR_CACHE_DIR" --out "$OUT_DIR/$CC_FILE" --max-bytes "$max" \
        --deadline-s "$(( left - 4 ))" --since "$CC_SINCE" 2>&1 | tee -a "$OUT_DIR/$2"
}

# With FLA_ENV: fla's rows (FLA_ROWS: in `first` those the criteria read, in `rest` every
# one at every length). fla_warm END PASS compiles them beside the
# other warm-up, ending END s after the start (its own folder: a copy of gpu.json for what is
# done, its gpu_warm.json; FLA_CACHE_RESULTS=0: the autotuner's choices made beside other
# work are not kept, the timed run makes its own from the compiled binaries). fla_rows
# SECONDS times them, in the bench's JSON, within that many seconds. A fault there (the CUDA
# context lost) ends fla's rows, recorded, and nothing else.
FLA_ROWS=(--only fla-chunk_simple_gla --lengths "$FLA_LENGTHS")
fla_warm() {
    local left=$(( $1 - SECONDS )) pass=$2
    [ "${#FLA_ENV[@]}" -gt 0 ] && [ "$left" -gt 20 ] || return 0
    rm -rf /tmp/fla_warm && mkdir -p /tmp/fla_warm && { cp "$OUT_DIR/gpu.json" /tmp/fla_warm/ 2>/dev/null || true; }
    env "${FLA_ENV[@]}" FLA_CACHE_RESULTS=0 timeout -s INT -k 10 "$left" "${FASTRPE[@]}" bench --suite gpu "${SMOKE_ARGS[@]}" --warm "$pass" \
        "${FLA_ROWS[@]}" --compile-mode "$COMPILE_MODE" --budget-s "$(( left - 10 ))" --out /tmp/fla_warm > /tmp/fla_warm.log 2>&1
}
fla_rows() {
    [ "${#FLA_ENV[@]}" -gt 0 ] && [ "$1" -gt 40 ] || return 0
    local again=()
    [ -f "$OUT_DIR/gpu.json" ] && again=(--resume)
    echo "${SECONDS} s used, fla's rows get $1 s" | tee -a "$OUT_DIR/gpu_${phase}.log"
    env "${FLA_ENV[@]}" timeout -s INT -k 10 "$1" "${FASTRPE[@]}" bench --suite gpu "${SMOKE_ARGS[@]}" --sections rows "${FLA_ROWS[@]}" \
        --compile-mode "$COMPILE_MODE" --budget-s "$(( $1 - 30 ))" --call-cap-s 60 --out "$OUT_DIR" "${again[@]}" 2>&1 | tee -a "$OUT_DIR/gpu_${phase}.log"
}

python3 - <<'EOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device",
      torch.cuda.get_device_name() if torch.cuda.is_available() else None)
try:
    import triton; print("triton", triton.__version__)
except Exception as e: print("triton absent:", e)
try:
    import fla; print("fla", fla.__version__)
except Exception as e: print("fla absent:", e)
EOF

# a previous phase's JSON (carried in .gpu_runs/) is resumed, never overwritten, if it was
# measured on a GPU of the same name (timings of different devices do not mix); `first`
# resuming one measures again, whole, each problem where a row failed (below)
# COMPILE_MODE: torch.compile's mode for the Flex baseline and fastrpe's +compiled rows alike
# (default "default"; "reduce-overhead" adds CUDA graphs to both). A carried JSON of another
# mode or device does not mix with this run's rows: it starts afresh.
COMPILE_MODE=${COMPILE_MODE:-default}
# (a fresh checkout has no .gpu_runs/: then the newest committed JSON of this GPU, if any,
# benchmarks/results/gpu/, `gpu.resume_source`)
if [ ! -f "$OUT_DIR/gpu.json" ] && [ -z "${SMOKE:-}" ]; then
    src=$(COMPILE_MODE="$COMPILE_MODE" python3 -c 'import os, sys, torch
from pathlib import Path
from fastrpe.bench.gpu import resume_source
if not torch.cuda.is_available():
    sys.exit(0)
p = resume_source(Path(".gpu_runs/gpu.json"), sorted(Path("benchmarks/results/gpu").glob("*.json")),
                  torch.cuda.get_device_name(), os.environ["COMPILE_MODE"])
print(p or "")')
    if [ -n "$src" ]; then
        echo "resuming $src (measured on this GPU)"
        cp "$src" "$OUT_DIR/gpu.json"
    else
        echo "no JSON of this GPU and compile mode in .gpu_runs/ or benchmarks/results/gpu/: starting afresh"
    fi
fi
resume=()
[ -f "$OUT_DIR/gpu.json" ] && resume=(--resume)
# `rest` times the PRF maps as `first` did on this machine: the launch `first` adopted from the
# sweep (step 1b'), as its runs recorded it (gpu.json's envs, `prf_launch`)
if [ "$phase" = rest ] && [ -z "${FASTRPE_PRF_LAUNCH:-}" ] && [ -f "$OUT_DIR/gpu.json" ]; then
    pick=$(python3 -c 'import json, sys
from fastrpe.bench.gpu import machine_id
envs = [e for e in json.load(open(sys.argv[1])).get("envs") or [] if e and e.get("machine") == machine_id()]
print(envs[-1].get("prf_launch", "") if envs else "")' "$OUT_DIR/gpu.json")
    [ -n "$pick" ] && export FASTRPE_PRF_LAUNCH="$pick" && echo "PRF maps: $pick, as first's rows on this machine"
fi
# `first` resuming a JSON measures again, whole, each problem where a row failed (the code has
# changed since: the 2026-11-26 run's Flex failures). Those problems' rows go before anything
# runs (gpu.retry_errors), so that every process after, the warm-up's, fla's and the bench's,
# sees the same rows, and no later step drops what an earlier one measured again. Two anchor
# rows are measured again too (gpu.ANCHORS: Flex + ALiBi at 4k, SDPA at 64k), and the rows whose
# code changed since the carried JSON (gpu.CHANGED, once per CODE_EPOCH): their
# two times say how far this session's machine is from the last one's (--check prints them),
# for the verdicts that set rows of two sessions against each other.
if [ "$phase" = first ] && [ -f "$OUT_DIR/gpu.json" ]; then
    python3 -c 'import json, sys
from fastrpe.bench.gpu import measure_again, retry_errors
res = json.load(open(sys.argv[1]))
rows, kept = res["rows"], retry_errors(res["rows"])
print(f"measured again: {len(rows) - len(kept)} rows of the problems where a row failed")
res["rows"] = kept
print(f"measured again: {measure_again(res)} anchor and changed rows (their earlier times kept)")
json.dump(res, open(sys.argv[1], "w"), indent=1)' "$OUT_DIR/gpu.json" || exit 1
fi
# the bench's sections in order: a resumed JSON holds the 4k and 64k rows already, so the cheap
# decoding and host-sync sections (never measured yet) go before the long rows (262k, 1M)
SECTIONS=${SECTIONS:-$([ -f "$OUT_DIR/gpu.json" ] && echo decode,sync,rows || echo rows,decode,sync)}

case "$phase" in
  first)
    # The whole phase ends by FIRST_S seconds (default 500) after the script started, the
    # device call's timeout_s (540) included with room to spare.
    # 0. in the background, beside the tests: the compile caches for the bench's first pass,
    #    until FIRST_WARM_S s after the start at the latest
    #    (resuming: the priority rows of 1c first, which would otherwise compile last, in the
    #    middle of their own timing)
    #    (fresh: the rows of its two windows, at their lengths)
    if [ "${#resume[@]}" -gt 0 ]; then
        warm_first=(--warm-first "$PRIORITY_ONLY")
    else
        warm_first=(--warm-first "$(at_length "$PRIORITY_FRESH" "$PRIORITY_LONG_LENGTHS"),$(at_length \
            "$PRIORITY_FRESH_SHORT" "$PRIORITY_FRESH_SHORT_LENGTH")")
    fi
    warm_until "${FIRST_WARM_S:-170}" first "${warm_first[@]}" &
    warm_pid=$!
    fla_warm "${FIRST_WARM_S:-170}" first &
    fla_warm_pid=$!
    # 0a. the PRF map kernels' launch choices (benchmarks/prf_sweep.py), compiled untimed
    prf_env=(); [ -n "${SMOKE:-}" ] && prf_env=(TRITON_INTERPRET=1)
    prf_warm_pid=
    if [ "${PRF_S:-20}" -gt 0 ]; then
        env "${prf_env[@]}" timeout -k 5 "${FIRST_WARM_S:-170}" python3 benchmarks/prf_sweep.py --warm "${PRF_ARGS[@]}" \
            > /tmp/prf_warm.log 2>&1 &
        prf_warm_pid=$!
    fi
    # 0b. FLA_PROBE=1: beside them, which fla kernel faults (CUDA_LAUNCH_BLOCKING=1, one
    #     process per variant), with fla's own triton where FLA_ENV gives one; its autotuning
    #     beside other work is not kept (FLA_CACHE_RESULTS=0), as the warm-up's. Off since the
    #     fifth H100 session answered it (2026-11-27: the bench's variants, fla's oversized
    #     tiles pruned, passed; benchmarks/results/gpu/h100-2026-11-27c-tests.json, fla_probe)
    probe_pid=
    if [ -n "${FLA_PROBE:-}" ] && env "${FLA_ENV[@]}" python3 -c 'import fla' 2>/dev/null; then
        env "${FLA_ENV[@]}" FLA_CACHE_RESULTS=0 timeout -k 5 "${FIRST_WARM_S:-170}" python3 benchmarks/fla_probe.py \
            > /tmp/fla_probe.log 2>&1 &
        probe_pid=$!
    fi
    # 1. the kernels against float64 at 4,096 (output and the three gradients) and at the bench's
    #    shapes: a broken kernel's timings mean nothing. SIGINT at the budget: pytest still
    #    prints every failure so far. Also fastrpe's `flex` backend with T5 against float64, one
    #    of the three table terms that failed on the first H100 without a message. First the
    #    16-bit modes (bf16x3, bf16 features), which the Hopper miscompile broke until 2026-11-27.
    FASTRPE_INSTAFAIL=1 gpu_tests "${FIRST_TESTS_S:-100}" "$OUT_DIR/gpu_tests.log" /tmp/gpu_tests.xml \
        -q -m gpu -p no:cacheprovider -rfEs --tb=short \
        tests/test_gpu.py tests/test_triton_chunked.py tests/test_triton_soe.py tests/test_triton_band.py \
        tests/test_triton_tiled.py tests/test_triton_prf.py tests/test_triton_recurrent.py \
        tests/test_fft_blocked_triton.py \
        -k "sixteen_bit or fused_maps or (float64 and nprf and (triton or fft)) or (float64 and flex and t5) or realistic or bench_shape or dense_bf16 or (fft_blocked_product and tiled)"
    # 1b. where an eager decoding step's host time goes (cProfile, about 15 s, while the warm-up
    #     ends): the sixth session's fused steps took 307-488 µs eagerly against 21-28 µs replayed
    #     from a CUDA graph, and the 5x criterion needs about 184 µs; the CPU's own profile
    #     (`--host`, launches stubbed) leaves CUDA's share out
    timeout -k 5 60 python3 benchmarks/decode_ops.py --profile 200 --dtypes bfloat16 --context 65536 \
        > /tmp/decode_profile.log 2>&1
    keep_log /tmp/decode_profile.log gpu_first.log "the fused decoding steps' host time (decode_ops.py --profile 200)" 120
    # a 16-bit mode that failed its float64 test here is not timed (gpu_tests_xml.py --faulty-rows)
    skip_rows
    [ -n "$FAULTY" ] && echo "not timed this session, their float64 tests failed here: $FAULTY" \
        | tee -a "$OUT_DIR/gpu_first.log"
    wait "$warm_pid" "$fla_warm_pid" $prf_warm_pid  # no timing beside the compilers
    [ -n "$prf_warm_pid" ] && keep_log /tmp/prf_warm.log gpu_first.log "the PRF sweep's compilations (prf_sweep.py --warm)"
    # the warm-ups' logs into the phase's log (a ninth file would not come back), fla's tail
    keep_log /tmp/gpu_warm_first.log gpu_first.log "the warm-up (fastrpe bench --suite gpu --warm first)"
    keep_log /tmp/fla_warm.log gpu_first.log "fla's warm-up (fla's processes)" 200
    # the probe's log into gpu_tests.log whatever its exit (non-zero exactly when a variant
    # faulted or ran out of time: the answers wanted)
    if [ -n "$probe_pid" ]; then
        wait "$probe_pid"
        keep_log /tmp/fla_probe.log gpu_tests.log "fla probe (benchmarks/fla_probe.py), exit $? (0 passed, 1 a variant failed, 2 or 124 out of time)"
    fi
    # 1b. where the rows' time goes (benchmarks/gpu_profile.py: kernels' device time per call,
    #     the GPU's busy share), at most PROFILE_S s, from the warm caches
    #     (PROFILE_S=45 since 2026-11-27: the 64k cases of PROFILE_ARGS only; 0, the default since
    #     the fifth H100 session, whose profile found the FFT path's gemv: none; its 45 s go to
    #     the criteria's rows, three of whose families were not reached)
    if [ "${PROFILE_S:-0}" -gt 20 ]; then
        timeout -s INT -k 5 "${PROFILE_S:-0}" python3 benchmarks/gpu_profile.py --budget-s "$(( ${PROFILE_S:-0} - 20 ))" "${PROFILE_ARGS[@]}" \
            --out "$OUT_DIR/gpu_profile.json" 2>&1 | grep -v '^USDT\|^STAGE:'
    fi
    # 1b'. the PRF map kernels timed over their launch choices, at most PRF_S s (default 20), into
    #     gpu_profile.json's "prf_sweep" (a ninth file would not come back). On the H100 the maps
    #     took 1.37 of triton_chunked's 5.6 ms ALiBi call at 64k, 9x their traffic's time. A choice
    #     clearly faster than the library's, with the same results (prf_sweep.py `choose`), is
    #     adopted for every bench row after this (FASTRPE_PRF_LAUNCH, which triton_prf reads when
    #     imported; each run's `prf_launch` in gpu.json's envs says which): the priority rows
    #     below measure it, and a later commit makes it triton_prf's default
    #     (PRF_S=0 was the default from the fourth session, which adopted 64:4:tf32x3, to the CPU
    #     session of 2026-11-28, which added programs walking 4 or 8 row tiles, `triton_prf.TILES`,
    #     to the configs, and their binaries to the pack: 20 s by default again)
    if [ "${PRF_S:-20}" -gt 0 ]; then
        env "${prf_env[@]}" timeout -s INT -k 5 "${PRF_S:-20}" python3 benchmarks/prf_sweep.py "${PRF_ARGS[@]}" \
            --out /tmp/prf_sweep.json 2>&1 | tail -40 | tee -a "$OUT_DIR/gpu_first.log"
        [ -f /tmp/prf_sweep.json ] && python3 -c 'import json, os, sys
p = json.load(open(sys.argv[1])) if os.path.exists(sys.argv[1]) else {}
p["prf_sweep"] = json.load(open(sys.argv[2]))
json.dump(p, open(sys.argv[1], "w"), indent=1)' "$OUT_DIR/gpu_profile.json" /tmp/prf_sweep.json
        pick=$([ -f /tmp/prf_sweep.json ] && python3 benchmarks/prf_sweep.py --choose /tmp/prf_sweep.json)
        if [ -n "$pick" ] && [ -z "${FASTRPE_PRF_LAUNCH:-}" ]; then
            export FASTRPE_PRF_LAUNCH="$pick"
            echo "PRF maps: the sweep's pick $pick is used by every row from here (FASTRPE_PRF_LAUNCH)" \
                | tee -a "$OUT_DIR/gpu_first.log"
        fi
    fi
    first_end=$(( ${FIRST_S:-500} - ${PACK_S:-35} ))
    capped() { echo $(( $1 < first_end ? $1 : first_end )); }
    # 1c. fla's rows (with FLA_ENV), at most FLA_S s, before the priority rows since the fifth
    #     H100 session (2026-11-27: its fla rows got the 46 s the windows left, less than their
    #     first call's compilation and autotuning, about 50 s; four criteria read them); not
    #     when the probe (FLA_PROBE=1) saw the bench's own variant fault (2026-11-26 and -27,
    #     before fla's oversized tiles were pruned, the row broke the CUDA context)
    #     (SMOKE: the probe needs a GPU, so it fails here; the rows' path runs regardless)
    resuming=${#resume[@]}  # (fla's run below may start gpu.json: the priority rows only resume)
    if [ -z "${SMOKE:-}" ] && [ -f /tmp/fla_probe.log ] && grep -Eq '^  simple_gla K=32 \(bench\) .*(FAIL|CRASHED)' /tmp/fla_probe.log; then
        echo "fla's rows not run: the probe's bench variant failed (gpu_tests.log)" | tee -a "$OUT_DIR/gpu_first.log"
    else
        fla_left=$(( first_end - SECONDS ))
        fla_rows "$(( ${FLA_S:-75} < fla_left ? ${FLA_S:-75} : fla_left ))"
    fi
    [ -f "$OUT_DIR/gpu.json" ] && resume=(--resume)  # fla's run may have started it
    # 1d. resuming: then the rows that the last session did not reach and that the next
    #     decisions hang on, at most PRIORITY_S s (default 150; 0: none): +compiled at 4k, and
    #     it and Flex with CUDA graphs (+cudagraphs; the 4k criteria read both pairings), the
    #     rows gpu.CHANGED moved (64k: STATE_SCAN "auto" now blocks triton_chunked and
    #     triton_band there) and their +sequential-scan twins, triton_soe's +saved-states; the
    #     64k ones first, in a call of their own
    #     Every window ends by the general pass's end (FIRST_S less PACK_S) at the latest: the
    #     windows' sum (150 + 150 + 120 + FLA_S) exceeds what is left after the warm-up and the
    #     profile, and a `first` past the device call's timeout would lose its pack and --check;
    #     what a window cannot start, `rest` runs (its general pass takes the 4k rows first)
    # (the sixth session ran the decaying terms' 1M rows first here, as the fourth and fifth had
    # never reached them: ALiBi passed, both KERPLEs failed at 156-240 ms, one term group per
    # term; their one row left, a first call of about 50 s of autotuning at 1M, comes after the
    # 64k window now: T5's and the learned tables' 64k ratios, never both timed in one run,
    # and ALiBi's, whose two sides are from two sessions, `gpu.unpaired`)
    if [ "$resuming" -gt 0 ] && [ "${PRIORITY_S:-150}" -gt 0 ]; then
        priority_end=$(capped $(( SECONDS + ${PRIORITY_S:-150} )))
        bench_until "$priority_end" gpu_first.log --resume --sections rows --passes 0,1 \
            --lengths "$PRIORITY_LONG_LENGTHS" --only "$PRIORITY_LONG" --families "$PRIORITY_LONG_FAMILIES"
        rows_1m "$(capped $(( SECONDS + ${PRIORITY_1M_S:-120} )))" gpu_first.log
        # (at least 150 s for the rest: bench_until keeps 85 s of each call's window in hand)
        bench_until "$(capped $(( priority_end > SECONDS + 150 ? priority_end : SECONDS + 150 )))" gpu_first.log \
            --resume --sections rows --passes 0,1 --lengths "$PRIORITY_LENGTHS" --only "$PRIORITY_ONLY"
    elif [ "${PRIORITY_S:-150}" -gt 0 ]; then
        # fresh (PRIORITY_FRESH above): the 64k criteria's deciding rows, then the 4k ones';
        # a window ends early when its rows are done (at least 110 s each: bench_until keeps
        # 85 s of a call's window in hand). The 64k window may take all that is left
        # (PRIORITY_FRESH_S, 200 s: after the tests, warm-up, PRF sweep and fla's rows about
        # 200 s remain, of which bench_until's 85 s in hand leave some 115 s of new rows): the
        # 4k rows passed on the H100 by 1.5-10x with CUDA graphs, the 64k ratios are the open
        # ones; what it leaves, `rest` runs
        bench_until "$(capped $(( SECONDS + ${PRIORITY_FRESH_S:-200} )))" gpu_first.log --resume --sections rows --passes 0 \
            --lengths "$PRIORITY_LONG_LENGTHS" --only "$PRIORITY_FRESH" --families "$PRIORITY_FRESH_FAMILIES"
        bench_until "$(capped $(( SECONDS + ${PRIORITY_SHORT_S:-110} )))" gpu_first.log --resume --sections rows \
            --passes 0 --lengths "$PRIORITY_FRESH_SHORT_LENGTH" --only "$PRIORITY_FRESH_SHORT"
    fi
    # 2. every row a criterion reads (gpu.reads), shortest length first, then decoding, then the
    #    host-sync check, until PACK_S s (default 35) before the end
    bench_until "$(( ${FIRST_S:-500} - ${PACK_S:-35} ))" gpu_first.log "${resume[@]}"
    # 3. the compile caches packed for the next session: from the bench's end (PACK_S - 15 s
    #    before FIRST_S at the latest) to 15 s before FIRST_S, the --check's
    pack_cache "$(( ${FIRST_S:-500} - 15 ))" gpu_first.log ;;
  rest)
    # what `first` left (its JSON carried in .gpu_runs/), ending within REST_S s of the start;
    # the compilations of what is left first (on a fresh machine the caches are cold), for at
    # most REST_WARM_S s (default: a third of REST_S, 120 at most)
    rest_s=${REST_S:-540}
    rest_warm=${REST_WARM_S:-$(( rest_s / 3 < 120 ? rest_s / 3 : 120 ))}
    # fla's other rows (chunk_linear_attn; 262k and 1M), which no criterion reads, only in the
    # last FLA_REST_S s (default 0: none; `first` timed the ones the criteria read)
    fla_rest=${FLA_REST_S:-0}
    FLA_ROWS=(--only 'fla-*' --lengths "$LENGTHS")
    fla_warm_pid=
    if [ "$fla_rest" -gt 0 ]; then
        fla_warm "$rest_warm" rest &
        fla_warm_pid=$!
    fi
    warm_until "$rest_warm" rest
    keep_log /tmp/gpu_warm_rest.log gpu_rest.log "the warm-up (fastrpe bench --suite gpu --warm rest)"
    if [ -n "$fla_warm_pid" ]; then
        wait "$fla_warm_pid"
        keep_log /tmp/fla_warm.log gpu_rest.log "fla's warm-up (fla's processes)" 200
    fi
    # the bench and fla's rows until PACK_S s before the end, then the pack (as in `first`);
    # first the 1M rows (PRIORITY_1M), if `first` left them (the general pass reaches them last),
    # then the learned tables at 262k (PRIORITY_262K)
    pack_s=${PACK_S:-35}
    rest_1m=$(( SECONDS + ${PRIORITY_1M_S:-120} )) rest_end=$(( rest_s - fla_rest - pack_s ))
    rows_1m $(( rest_1m < rest_end ? rest_1m : rest_end )) gpu_rest.log
    rest_262k=$(( SECONDS + ${PRIORITY_262K_S:-120} ))
    bench_until $(( rest_262k < rest_end ? rest_262k : rest_end )) gpu_rest.log --resume --sections rows --passes 0,1 \
        --lengths "$PRIORITY_262K_LENGTHS" --only "$PRIORITY_262K" --families "$PRIORITY_262K_FAMILIES"
    bench_until "$(( rest_s - fla_rest - pack_s ))" gpu_rest.log --resume
    fla_left=$(( rest_s - pack_s - SECONDS - 20 ))
    fla_rows "$(( fla_rest < fla_left ? fla_rest : fla_left ))"
    pack_cache "$(( rest_s - 15 ))" gpu_rest.log ;;
  short)
    fastrpe bench --suite gpu --lengths 4096,16384,65536 --budget-s 480 --out "$OUT_DIR" "${resume[@]}" \
        2>&1 | tee "$OUT_DIR/gpu_short.log" ;;
  long)
    fastrpe bench --suite gpu --lengths 262144,1048576 --budget-s 480 --out "$OUT_DIR" "${resume[@]}" \
        2>&1 | tee "$OUT_DIR/gpu_long.log" ;;
  tests)
    # SIGINT at the budget: pytest then still prints every failure so far with its message and
    # writes the junit XML (the first H100 call was killed by SIGTERM at 95 % and printed none);
    # resumed after a test that breaks the CUDA context (`gpu_tests`).
    # TESTS_K narrows the run (pytest -k), e.g. TESTS_K='4096_bf16 and (flex or triton)'.
    k=(); [ -n "${TESTS_K:-}" ] && k=(-k "$TESTS_K")
    gpu_tests "${TESTS_BUDGET:-540}" "$OUT_DIR/gpu_tests.log" "$OUT_DIR/gpu_tests.xml" \
        -q -m gpu tests/ -p no:cacheprovider -rfEs --tb=short --durations=15 "${k[@]}"
    exit $? ;;
  auto)
    python3 benchmarks/auto_cpu_check.py --device cuda --lengths 1024,4096,16384 --out "$OUT_DIR/auto_check_fwd.json" \
        2>&1 | tee "$OUT_DIR/auto_check.log"
    python3 benchmarks/auto_cpu_check.py --device cuda --grad --lengths 1024,4096,16384 \
        --out "$OUT_DIR/auto_check_grad.json" 2>&1 | tee -a "$OUT_DIR/auto_check.log" ;;
  check) ;;
  *) echo "usage: $0 first|rest|short|long|tests|auto|check"; exit 2 ;;
esac
# printed only: a device call brings back 8 files, and --check reruns anywhere from gpu.json
fastrpe bench --suite gpu --check "$OUT_DIR/gpu.json"
n_out=$(find "$OUT_DIR" -type f | wc -l)
[ "$n_out" -le 8 ] || echo "WARNING: $n_out files in $OUT_DIR, a device call brings back 8: $(ls "$OUT_DIR" | tr '\n' ' ')"
exit 0
