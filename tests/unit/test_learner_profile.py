"""benchmarks/learner_profile.py: kernel names fall into the right categories (CPU op names from a real profile,
typical H100/H200 kernel names), interval unions and GPU idle time are exact on hand-made intervals, kernels are
charged to the phase and scope of the CPU call that launched them, and the --tiny run works end to end."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from learner_profile import (  # noqa: E402
    HEAD_RANGE,
    analyze,
    classify,
    gaps,
    intersection_length,
    main,
    merge_intervals,
    profile_events,
    self_times,
    split_by_phase,
    summary_table,
    union_length,
    write_trace,
)

GPU_NAMES = [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel"
     "__5x_cublas", "", "gemm"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT", "", "gemm"),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn", "", "gemm"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, false, "
     "false>(cublasLt::cublasSplitKParams<float>, float const*, __nv_bfloat16 const*)", "", "gemm"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>(...)", "", "gemm"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT", "head", "gemm_head"),
    ("triton_tem_fused_mm_0", "", "gemm"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, "
     "cutlass::bfloat16_t, Flash_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t> >, false, true, false, false, "
     "true, true, false, false>(pytorch_flash::Flash_fwd_params)", "", "attn_fwd"),
    ("flash_fwd_kernel", "", "attn_fwd"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64, 128, 128, 8, 2, "
     "4, 2, false, false, cutlass::bfloat16_t, Flash_kernel_traits<64, 128, 128, 8, cutlass::bfloat16_t> >, false, "
     "false, false, false, false, false, false>(pytorch_flash::Flash_bwd_params)", "", "attn_bwd"),
    ("void pytorch_flash::flash_bwd_dot_do_o_kernel<true, Flash_bwd_kernel_traits<...> >(pytorch_flash::"
     "Flash_bwd_params)", "", "attn_bwd"),
    ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t, "
     "cutlass::arch::Sm80, true, 64, 128, 64, true, true>::Params)", "", "attn_fwd"),
    ("fmha_cutlassB_bf16_aligned_64x64_k64_sm80(PyTorchMemEffAttention::AttentionBackwardKernel<cutlass::arch::"
     "Sm80, cutlass::bfloat16_t, true, false, true, 64, 64, 64, false>::Params)", "", "attn_bwd"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64_4x1x1_kernel0_0", "", "attn_fwd"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_5_64x128x64_4x1x1_kernel0_0", "", "attn_bwd"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "", "elementwise"),
    ("triton_poi_fused_mul_silu_1", "", "elementwise"),
    ("triton_poi_fused__scaled_dot_product_efficient_attention_transpose_2", "", "elementwise"),
    ("triton_red_fused_exp_masked_fill_mul_sub_sum_0", "head", "head"),
    ("triton_poi_fused__to_copy_arange_eq_exp_mul_sub_where_1", "head", "head"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, float, "
     "at::native::binary_internal::MulFunctor<float> >, std::array<char*, 3ul> >(int, ...)", "", "elementwise"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float, float, "
     "float>, unsigned int, float, 4, 4> >(at::native::ReduceOp<...>)", "", "elementwise"),
    ("void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, "
     "true>(...)", "", "elementwise"),
    ("void at::native::multi_tensor_apply_kernel<at::native::(anonymous namespace)::TensorListMetadata<4>, "
     "at::native::(anonymous namespace)::PointwiseOpScalarListFunctor<float, 4, 3, 3>, std::divides<float> >(...)",
     "optimizer", "optimizer"),
    ("void at::native::(anonymous namespace)::fused_adamw_kernel<float>(...)", "", "optimizer"),
    ("void at::native::(anonymous namespace)::chunk_cat_cuda_kernel<float, float>(...)", "", "fsdp"),
    ("void at::native::(anonymous namespace)::split_with_sizes_copy_out_contiguous_no_cast_kernel<c10::BFloat16>"
     "(...)", "", "fsdp"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "", "fsdp"),
    ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "", "fsdp"),
    ("ncclDevKernel_AllReduce_Sum_f64_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "", "other"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(...)>(...)", "fsdp", "fsdp"),
    ("Memcpy DtoD (Device -> Device)", "", "memcpy"),
    ("Memcpy HtoD (Pinned -> Device)", "", "memcpy"),
    ("Memset (Device)", "", "memcpy"),
    ("Memcpy DtoH (Device -> Pageable)", "head", "head"),
]
# CPU op names as they come out of a --tiny profile
CPU_NAMES = [
    ("aten::mm", "", "gemm"), ("aten::addmm", "", "gemm"), ("aten::mm", "head", "gemm_head"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "", "attn_fwd"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "", "attn_bwd"),
    ("autograd::engine::evaluate_function: ScaledDotProductFlashAttentionForCpuBackward0", "", "attn_bwd"),
    ("aten::mul", "", "elementwise"), ("aten::embedding_dense_backward", "", "elementwise"),
    ("aten::mul_", "head", "head"), ("fsdp::all_gather_copy_in", "", "fsdp"), ("c10d::allgather_", "", "fsdp"),
    ("aten::copy_", "fsdp", "fsdp"), ("aten::_foreach_add_", "optimizer", "optimizer"),
    ("PythonSubclass", "optimizer", "optimizer"), ("MmBackward0", "", "other"),
    ("RegisterPostBackwardFunctionBackward", "", "other"),
]


@pytest.mark.parametrize("name,scope,want", GPU_NAMES + CPU_NAMES, ids=lambda x: x[:40] if isinstance(x, str) else x)
def test_classify_kernel_and_op_names(name, scope, want):
    assert classify(name, scope) == want


def test_interval_union_and_merge():
    iv = [(0, 10), (5, 12), (20, 25), (24, 30), (40, 40), (50, 45)]
    assert merge_intervals(iv) == [(0, 12), (20, 30)]
    assert union_length(iv) == 22
    assert union_length(iv, lo=8, hi=22) == 4 + 2
    assert union_length([]) == 0


def test_gaps_intersections_and_the_phase_split():
    assert gaps([(2, 4), (3, 6), (8, 9)], 0, 10) == [(0, 2), (6, 8), (9, 10)]
    assert gaps([(-5, 20)], 0, 10) == [] and gaps([], 0, 10) == [(0, 10)]
    assert intersection_length([(0, 10), (20, 30)], [(5, 25)]) == 10
    ranges = {"fwd_bwd": [(0, 50)], "forward": [(0, 20)], "h2d": [(15, 18), (60, 61)], "loss": [(20, 22)],
              "optimizer": [(50, 70)]}
    assert split_by_phase([(0, 100)], ranges) == {"loss": 2, "h2d": 4, "forward": 17, "optimizer": 19,
                                                  "backward": 28, "other": 30}


def test_self_times_subtract_direct_children_per_thread():
    ops = [dict(name="a", ts=0, dur=10, tid=1), dict(name="b", ts=1, dur=4, tid=1), dict(name="c", ts=2, dur=1, tid=1),
           dict(name="d", ts=6, dur=3, tid=1), dict(name="e", ts=3, dur=5, tid=2)]
    got = {o["name"]: (t, top) for o, t, top in self_times(ops)}
    assert got == {"a": (3, True), "b": (3, False), "c": (1, False), "d": (3, False), "e": (5, True)}


def _ev(cat, name, ts, dur, corr=None, link=None, tid=0):
    return dict(cat=cat, name=name, ts=ts, dur=dur, corr=corr, link=link, tid=tid)


def test_kernels_charged_to_the_phase_and_scope_of_their_launch_and_idle_is_the_uncovered_time():
    ann = "user_annotation"
    events = [
        _ev(ann, "phase/step", 0, 100), _ev(ann, "phase/fwd_bwd", 0, 80), _ev(ann, "phase/forward", 0, 40),
        _ev(ann, "FSDP::all_gather (model.layers.0)", 1, 2), _ev(ann, HEAD_RANGE + ".forward", 30, 10),
        _ev(ann, "phase/loss", 40, 2), _ev(ann, "phase/optimizer", 80, 15),
        _ev("gpu_user_annotation", "phase/forward", 0, 100),  # the GPU copy of a range: not a CPU range
        _ev("cpu_op", "aten::mm", 5, 1, corr=501), _ev("cpu_op", "aten::mul", 6, 1, corr=502),
        _ev("cpu_op", "FusedHeadLogprob", 29, 12, corr=503),  # the autograd Function: starts before the head range
        _ev("cuda_runtime", "cudaLaunchKernel", 2, 0.5, corr=7),
        _ev("cuda_driver", "cuLaunchKernel", 31, 0.5, corr=8, link=503),
        _ev("cuda_runtime", "cudaLaunchKernel", 35, 0.5, corr=9),
        _ev("cuda_runtime", "cudaLaunchKernel", 50, 0.5, corr=10),
        _ev("cuda_runtime", "cudaLaunchKernel", 85, 0.5, corr=11),
        _ev("cuda_runtime", "cudaMemcpyAsync", 97, 0.5, corr=12),
        _ev("cuda_runtime", "cudaLaunchKernel", 60, 0.1, corr=13),  # launched after its kernel started: not its launch
        _ev("cuda_runtime", "cudaLaunchKernel", 81, 0.1, corr=14, link=999),  # names another op than its kernel
        # kernels (GPU timeline)
        _ev("kernel", "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT", 10, 10, corr=90, link=501, tid=7),  # via its op
        _ev("kernel", "void at::native::vectorized_elementwise_kernel<4>", 15, 10, link=502, tid=20),  # other stream
        _ev("kernel", "void at::native::unrolled_elementwise_kernel<direct_copy>", 3, 5, corr=7, tid=30),  # in FSDP's
        _ev("kernel", "triton_red_fused_exp_sub_sum_0", 32, 4, corr=8, link=503, tid=7),  # launched in the head
        _ev("kernel", "nvjet_tst_64x8_64x16_4x1_v_bz_TNN", 36, 4, corr=9, tid=7),
        _ev("kernel", "pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", 50, 20, corr=10, tid=7),
        _ev("kernel", "void at::native::reduce_kernel<512>", 58, 4, corr=13, tid=7),  # unlinked: its own start
        _ev("kernel", "void at::native::multi_tensor_apply_kernel<...>", 85, 5, corr=11, tid=7),
        _ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 97, 1, corr=12, tid=7),
        _ev("kernel", "void at::native::vectorized_elementwise_kernel<4, FillFunctor>", 91, 1, corr=14, link=502,
            tid=7),  # its call is not trusted: its op's start (6, forward) is
        _ev("kernel", "late_kernel", 120, 5, tid=7),  # after the step: not part of it
    ]
    p = analyze(events, gpu=True)
    cats = p["categories"]
    assert p["n_kernels"] == 10 and p["linked_fraction"] == pytest.approx(9 / 10)
    assert cats["gemm"]["by_phase"]["forward"] == pytest.approx(0.010) and cats["gemm"]["count"] == 1
    assert cats["gemm_head"]["by_phase"]["forward"] == pytest.approx(0.004)
    assert cats["head"]["by_phase"]["forward"] == pytest.approx(0.004)
    assert cats["fsdp"]["by_phase"]["forward"] == pytest.approx(0.005)
    assert cats["elementwise"]["by_phase"]["forward"] == pytest.approx(0.011)
    assert cats["elementwise"]["by_phase"]["backward"] == pytest.approx(0.004)  # its own start, 58, is in backward
    assert cats["attn_bwd"]["by_phase"]["backward"] == pytest.approx(0.020)
    assert cats["optimizer"]["by_phase"]["optimizer"] == pytest.approx(0.005)
    assert cats["memcpy"]["by_phase"]["other"] == pytest.approx(0.001)
    assert p["head_ms"] == pytest.approx(0.008)
    # busy: [3,8] [10,25] [32,40] [50,70] [85,90] [91,92] [97,98] = 5 + 15 + 8 + 20 + 5 + 1 + 1 (streams overlap 15-20)
    assert p["window_ms"] == pytest.approx(0.100) and p["busy_ms"] == pytest.approx(0.055)
    assert p["idle_ms"] == pytest.approx(0.045)
    assert p["kernel_ms"] == pytest.approx(0.064)
    walls = {k: v["wall_ms"] for k, v in p["phases"].items()}
    assert walls == pytest.approx({"forward": 0.040, "loss": 0.002, "backward": 0.038, "optimizer": 0.015,
                                   "h2d": 0.0, "other": 0.005})
    # idle gaps [0,3] [8,10] [25,32] [40,50] [70,85] [90,91] [92,97] [98,100], by the CPU's phase meanwhile
    idle = {k: v["idle_ms"] for k, v in p["phases"].items()}
    assert idle == pytest.approx({"forward": 0.012, "loss": 0.002, "backward": 0.018, "optimizer": 0.009,
                                  "h2d": 0.0, "other": 0.004})
    assert [t["name"] for t in p["top"][:2]] == ["pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel",
                                                 "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT"]
    with pytest.raises(ValueError, match="no 'phase/step' range"):
        analyze([e for e in events if e["name"] != "phase/step"], gpu=True)


def test_trace_file_drops_launches_then_short_kernels_to_fit_its_limit(tmp_path):
    import gzip
    import random

    rng = random.Random(0)
    events = [_ev("user_annotation", "phase/step", 0, 1e6)]
    for i in range(3000):  # incompressible names: the size follows the event count
        events.append(_ev("cuda_runtime", f"cudaLaunchKernel{rng.random()}", i * 300.0, 2, corr=i))
        events.append(_ev("kernel", f"k{rng.random()}", i * 300.0 + 5, 30 if i % 10 == 0 else 5, corr=i, tid=7))
    path = tmp_path / "t.json.gz"
    sizes = {}
    for limit in (10**7, 60_000, 10_000, 1000):
        path.unlink(missing_ok=True)
        what = write_trace(events, path, gpu=True, limit_bytes=limit)
        if what.startswith("not written"):
            assert not path.exists() and "limit 0 MiB" in what
            continue
        trace = json.loads(gzip.decompress(path.read_bytes()))
        assert path.stat().st_size <= limit
        cats = {e["cat"] for e in trace["traceEvents"]}
        sizes[limit] = (trace["otherData"]["content"], len(trace["traceEvents"]), cats)
    assert sizes[10**7] == ("complete", 6001, {"user_annotation", "cuda_runtime", "kernel"})
    assert sizes[60_000] == ("no launches or CPU ops", 3001, {"user_annotation", "kernel"})
    assert sizes[10_000] == ("no launches or CPU ops, kernels >= 20 us", 301, {"user_annotation", "kernel"})
    assert 1000 not in sizes


def test_a_real_cpu_profile_through_the_chrome_trace(tmp_path):
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    lin = torch.nn.Linear(32, 32)
    x = torch.randn(16, 32)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("phase/step"):
            with record_function("phase/fwd_bwd"):
                with record_function("phase/forward"):
                    y = torch.relu(lin(x)).sum()
                y.backward()

    class NoKineto:  # a torch whose kineto results cannot be read: profile_events exports the chrome trace
        profiler = None
        export_chrome_trace = prof.export_chrome_trace

    p = analyze(profile_events(NoKineto(), tmp_path), gpu=False)
    assert not (tmp_path / "profile_trace.json").exists()
    direct = analyze(profile_events(prof, tmp_path), gpu=False)  # the same step from the kineto results
    counts = {c: v["count"] for c, v in p["categories"].items()}
    assert {c: v["count"] for c, v in direct["categories"].items()} == counts
    assert direct["window_ms"] == pytest.approx(p["window_ms"], abs=1e-3)
    cats = p["categories"]
    assert cats["gemm"]["by_phase"]["forward"] > 0 and cats["gemm"]["by_phase"]["backward"] > 0
    assert cats["elementwise"]["count"] > 0
    # self times of one thread's ops never add up to more than the step (0.1 us of float rounding in sums of
    # thousands of microsecond timestamps; an op counted twice would be >= 1 us over)
    assert 0 < p["kernel_ms"] <= p["busy_ms"] + 1e-4 and p["busy_ms"] <= p["window_ms"] + 1e-4


def test_a_bad_variant_stops_before_any_model_is_built(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["learner_profile.py", "--tiny", "--out", str(tmp_path), "--variants",
                                      "base;bad:train.no_such_key=1"])
    with pytest.raises(SystemExit) as exc:
        main()
    message = str(exc.value)
    assert message.startswith("--variants: variant 'bad' (train.no_such_key=1): ") and "no_such_key" in message
    assert not (tmp_path / "model_tiny").exists()


def test_summary_names_a_failed_variant_and_keeps_the_timings_of_a_failed_breakdown():
    timed = dict(size="0.5b", variant="base", overrides=[], step_s=3.85, tokens_per_s=102140.0, mfu_pct=36.1,
                 peak_gib=41.0, error="profile breakdown: RuntimeError: no kernel events")
    lines = summary_table([{"size": "tiny", "variant": "cl", "overrides": ["train.compile_layers=true"],
                            "error": "RuntimeError: boom"}, timed]).splitlines()
    assert lines[1].split()[:3] == ["tiny", "cl", "FAILED:"] and "RuntimeError: boom" in lines[1]
    assert "[train.compile_layers=true]" in lines[1]
    assert lines[2].split()[:7] == ["0.5b", "base", "3.850", "102140", "36.1", "41.0", "FAILED:"]
    assert "no kernel events" in lines[2]


@pytest.mark.slow
def test_tiny_end_to_end_on_cpu(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "learner_profile.py"), "--tiny", "--steps", "1",
                        "--warmup", "0", "--out", str(tmp_path / "w"), "--report-dir", str(tmp_path / "rep"),
                        "--trace", str(tmp_path / "tr")],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    (res,) = json.loads((tmp_path / "rep" / "results.json").read_text())
    assert res["variant"] == "base" and res["B"] == 8 and res["microbatches"] == 2 and len(res["step_times"]) == 1
    p = res["profile"]
    cats = p["categories"]
    for c in ("gemm", "gemm_head", "attn_fwd", "attn_bwd", "head", "optimizer", "fsdp"):
        assert cats[c]["count"] > 0, c  # the head's range (fused_head.PROFILE_RANGE) and FSDP's ranges were seen
    assert cats["attn_fwd"]["by_phase"]["forward"] > 0 and cats["attn_bwd"]["by_phase"]["backward"] > 0
    assert cats["optimizer"]["ms"] == pytest.approx(cats["optimizer"]["by_phase"]["optimizer"])
    assert all(p["phases"][ph]["wall_ms"] > 0 for ph in ("forward", "loss", "backward", "optimizer"))
    assert p["kernel_ms"] <= p["window_ms"] * 1.001
    assert (tmp_path / "tr" / "trace_tiny_base.json.gz").stat().st_size > 1000
    tables = (tmp_path / "rep" / "tables.txt").read_text()
    assert "GEMM (LM head)" in tables and "idle (no kernel running)" in tables and "top 30 by total time" in tables


def test_synthetic_batch_takes_per_sample_lengths_for_the_long_tailed_workload():
    from streamrft.learner.synthetic import synthetic_batch

    batch = synthetic_batch(4, 3, [5, 1, 9, 2], vocab=50, samples=2)
    assert [len(s.response_ids) for s in batch] == [5, 1, 9, 2]
    assert all(len(s.behaviour_logprobs) == len(s.advantages) == len(s.response_ids) for s in batch)
    assert [s.header.completion.group_id for s in batch] == ["g0", "g0", "g1", "g1"]
    assert [len(s.response_ids) for s in synthetic_batch(2, 3, 4, vocab=50, samples=2)] == [4, 4]
