"""Published throughput of large training runs, as data, for validating the planner.

Each entry names a model shape, a cluster, a parallel plan and the throughput its source
reported, plus that number converted to tokens/s per device (the formula is in `note`).
This is a held-out check: the planner's constants must never be fitted or tuned to it.
Numbers are as published; where a source leaves something out, the field is None or the
note says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shoal.models.config import PRESETS, ModelConfig


@dataclass(frozen=True, kw_only=True)
class PublishedRun:
    name: str
    model: ModelConfig
    """The shape; max_seq_len is the run's sequence length."""
    cluster: str
    """shoal cluster syntax: "1024xA100-80GB" (8 per node) or "NODESxPERxDEVICE"."""
    plan: str
    """shoal plan syntax; options the source does not give are left out (see `note`)."""
    global_batch: int
    """Sequences per optimizer step."""
    seq_len: int
    micro_batch_size: int | None
    """Sequences per micro-batch, where the source says."""
    reported: float
    unit: str
    """tflops_per_gpu_hw (counts recompute), tflops_per_gpu_model, tokens_per_s_per_gpu or mfu."""
    tokens_per_s_per_device: float
    """Derived from `reported` by the formula in `note`."""
    source: str
    note: str
    fused_attention: bool = True
    """False for trainers that ran attention unfused (QK^T, softmax, AV as separate kernels):
    Megatron-LM and its forks before FlashAttention (2022)."""
    selective_policy: str = "shoal"
    """What the trainer's selective recompute keeps (bench.framework_models.SELECTIVE_POLICIES): "torchtitan-op"
    for torchtitan's runs, which use its per-op policy (selective_ac_option 'op' in its llama3 8B train config);
    "megatron" for Korthikanti et al. 2022's, whose selective recompute (section 5) reruns the attention core."""
    data_engine: str = "shoal"
    """Who ran the data axes (bench.framework_models.DATA_ENGINES): "deepspeed-pipe" for Megatron-DeepSpeed's
    runs, whose pipeline engine reduces (and at ZeRO-1 gathers) once a step after the last backward."""
    unsharded_accumulation: bool = False
    """True for FSDP2 under torch.distributed.pipelining (torchtitan's pipelines), which accumulates unsharded
    gradients across micro-batches (bench.framework_models.framework)."""
    fused_qkv: bool = False
    """True for trainers whose attention projects Q, K and V with one weight (shoal.planner.estimate.Framework.
    fused_qkv): Megatron-LM's and Megatron-DeepSpeed's ParallelAttention (query_key_value), metaseq's
    ModelParallelMultiheadAttention (combine_qkv_proj); torchtitan's Llama has wq, wk and wv."""
    pipe_scatter: bool = False
    """True for pipelines that send each tensor-parallel rank's share of an activation and gather it on arrival
    (shoal.planner.estimate.Framework.pipe_scatter): Megatron-LM's, and DeepSpeed's pipeline engine
    (Megatron-DeepSpeed's runs)."""
    tp_engine: str = "dtensor"
    """Who ran tensor parallelism (bench.framework_models.TP_ENGINES): "megatron" for Megatron-LM's own layers, whose
    sequence parallelism keeps less than DTensor's (it matters only under sp)."""
    checked: bool = True
    """False where a number the prediction needs was not stated by the source or could not be re-read
    in it here (recalled, assumed, or a precision shoal cannot express); `note` says which."""


# GPT-3-style blocks as Megatron-LM builds them: LayerNorm, GeLU MLP of 4h, learned absolute
# positions, biases, input and output embeddings tied; attention and hidden dropout 0.1, Megatron-LM's
# defaults (--attention-dropout, --hidden-dropout in megatron/arguments.py at de7dc40f88), which none of
# the scripts read here changes (examples/sc21; Korthikanti et al. 2022 count the dropout masks in their
# activation memory, section 4.1), and metaseq's OPT launcher sets (--dropout 0.1 --attention-dropout 0.1 in
# metaseq/launcher/opt_baselines.py).
_GPT: dict[str, Any] = dict(norm="layernorm", activation="gelu", pos_emb="learned", bias=True, tie_embeddings=True,
                            dropout=0.1)


_UNTIED = ("The model ties input and output embeddings; with pp > 1 Megatron-style pipelines hold a copy "
           "of the word embedding on the first and the last stage and all-reduce its gradient between "
           "them, so tie_embeddings=False is recorded (two copies hold the memory of an untied head, as "
           "shoal's pipeline holds them too; the FLOPs are the same). ")


def _gpt(layers: int, hidden: int, heads: int, vocab: int, seq: int, *, pp: int = 1) -> ModelConfig:
    return ModelConfig(num_layers=layers, dim=hidden, num_heads=heads, ffn_dim=4 * hidden,
                       vocab_size=vocab, max_seq_len=seq, **{**_GPT, "tie_embeddings": pp == 1})


# --- Narayanan et al. 2021 (Megatron-LM, PTD-P), Table 1 -------------------------------------
_MEGATRON21_SRC = ("https://arxiv.org/abs/2104.04473 Table 1 (weak scaling); the same rows as the image "
                   "images/cases_april2021.png in github.com/NVIDIA/Megatron-LM README (2021-04 .. 2024-07); the "
                   "runs' settings from examples/sc21/run_table_1.sh and CONFIG.sh (github.com/NVIDIA/Megatron-LM "
                   "de7dc40f88, 2021-08-10, 'scripts for sc21': 'scripts that were used to produce the results')")
_MEGATRON21_NOTE = (
    "Selene, DGX A100 80GB. Vocab 51,200, seq 2048 for every row (README). Achieved TFLOP/s count the "
    "recompute forward: F = 96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h)) per iteration (paper eq. 3, full "
    "activation recompute), so tokens/s/GPU = reported*1e12 / (96*l*h^2*(1 + s/(6h) + V/(16*l*h))). "
    "Heads and the tp/pp split are from the paper's Table 1 (the README image gives only tp*pp); "
    "dp = GPUs/(tp*pp). From run_table_1.sh: the micro-batch size (MBS), so mb = GBS/(dp*MBS) micro-batches a "
    "pipeline; the interleaved schedule where it passes --num-layers-per-virtual-pipeline-stage (vpp = layers a "
    "stage / that number), otherwise 1F1B; --DDP-impl torch (torch's DDP, its all-reduce overlapping backward) "
    "up to 18B and local (one all-reduce after the last backward: data_engine megatron-local) from 39B; "
    "--checkpoint-activations (ac=full) and --fp16 (CONFIG.sh, with a static loss scale of 8192); the gradients "
    "all-reduced in fp16 (reduce=fp16): torch's DDP reduces the fp16 model's own, and the local DDP without "
    "--accumulate-allreduce-grads-in-fp32 or --use-contiguous-buffers-in-ddp (neither script sets them) flattens "
    "each param.grad in the parameters' dtype and all-reduces that (megatron/model/distributed.py). No sequence "
    "parallelism existed then (sp=off). Dropout 0.1 on the attention probabilities and the hidden states: "
    "Megatron-LM's defaults (megatron/arguments.py at that commit), which neither script changes."
)


def _megatron21(params: str, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int, batch: int,
                tflops: float, tokens: float, *, mbs: int, ddp: str, layers_per_chunk: int | None = None
                ) -> PublishedRun:
    dp = gpus // (tp * pp)
    axes = [f"tp{tp}"] if tp > 1 else []
    if pp > 1:
        axes += [f"pp{pp}", f"mb={batch // (dp * mbs)}"]
        axes += [f"sched=interleaved,vpp={layers // pp // layers_per_chunk}"] if layers_per_chunk else ["sched=1f1b"]
    opts = ["ac=full", "precision=fp16", "reduce=fp16"] + (["sp=off"] if tp > 1 else [])
    return PublishedRun(fused_attention=False, fused_qkv=True, pipe_scatter=True,
        data_engine="megatron-local" if ddp == "local" else "shoal",
        name=f"Megatron-LM 2021, GPT {params} on {gpus} A100",
        model=_gpt(layers, hidden, heads, 51200, 2048, pp=pp),
        cluster=f"{gpus}xA100-80GB",
        plan=",".join(axes + opts),
        global_batch=batch, seq_len=2048, micro_batch_size=mbs,
        reported=tflops, unit="tflops_per_gpu_hw", tokens_per_s_per_device=tokens,
        source=_MEGATRON21_SRC,
        note=_MEGATRON21_NOTE + f" dp={dp}, MBS {mbs}, --DDP-impl {ddp}. " + (_UNTIED if pp > 1 else ""),
    )


_MEGATRON21 = (
    _megatron21("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137, 9287.9, mbs=16, ddp="torch"),
    _megatron21("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138, 4431.2, mbs=16, ddp="torch"),
    _megatron21("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142, 2216.3, mbs=16, ddp="torch"),
    _megatron21("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135, 871.6, mbs=8, ddp="torch"),
    _megatron21("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138, 425.1, mbs=4, ddp="local"),
    _megatron21("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140, 223.2, mbs=2, ddp="local", layers_per_chunk=5),
    _megatron21("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148, 123.8, mbs=2, ddp="local", layers_per_chunk=5),
    _megatron21("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155, 61.3, mbs=1, ddp="local", layers_per_chunk=3),
    _megatron21("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163, 37.9, mbs=1, ddp="local", layers_per_chunk=1),
    _megatron21("1T", 160, 25600, 128, 8, 64, 3072, 3072, 163, 20.0, mbs=1, ddp="local"),
)

# --- Korthikanti et al. 2022 (sequence parallelism + selective recompute) ---------------------
_KORTHI_SRC = ("https://arxiv.org/abs/2205.05198 Table 3 (configurations) and the end-to-end table "
               "(MFU/HFU); MFU/HFU also in the NVIDIA/Megatron-LM README from commit 2e90a342f5 (2022-05)")
_KORTHI_NOTE = (
    "Benchmark runs at data-parallel size 1 (README). A100 80GB (Selene), vocab 51,200, seq 2048. "
    "Reported value is MFU (model FLOPs, no recompute) against 312 TFLOP/s; the paper's model FLOPs per "
    "iteration are 72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h)), so tokens/s/GPU = MFU*312e12 / "
    "(72*l*h^2*(1 + s/(6h) + V/(12*l*h))). HFU (counting the selective recompute) is {hfu}. "
    "Heads, batch and micro-batch are from the paper's Table 3 (read from the paper, not re-checked "
    "against a second copy); the iteration times in the paper's end-to-end table reproduce the MFU "
    "with these B, l, h and GPU counts. Pipeline schedule not restated there, so sched is left out. "
    "16-bit precision type not stated in what I read; bf16 recorded (same A100 peak)."
)


def _korthi(size: str, heads: int, hidden: int, layers: int, pp: int, gpus: int, batch: int, mbs: int,
            mfu: float, hfu: float, tokens: float) -> PublishedRun:
    mb = [f"pp{pp}", f"mb={batch // mbs}"] if pp > 1 else []
    return PublishedRun(fused_attention=False, fused_qkv=True, tp_engine="megatron", selective_policy="megatron",
        pipe_scatter=True,
        name=f"Megatron-LM 2022 (seq-parallel + selective recompute), GPT {size} on {gpus} A100", checked=False,
        model=_gpt(layers, hidden, heads, 51200, 2048, pp=pp),
        cluster=f"{gpus}xA100-80GB",
        plan=",".join(["tp8", *mb, "ac=selective", "precision=bf16"]),
        global_batch=batch, seq_len=2048, micro_batch_size=mbs,
        reported=mfu, unit="mfu", tokens_per_s_per_device=tokens,
        source=_KORTHI_SRC, note=_KORTHI_NOTE.format(hfu=f"{hfu:.1%}") + (" " + _UNTIED if pp > 1 else ""),
    )


_KORTHIKANTI = (
    _korthi("22B", 64, 6144, 48, 1, 8, 4, 4, 0.415, 0.437, 927.5),
    _korthi("175B", 96, 12288, 96, 8, 64, 64, 1, 0.514, 0.528, 149.0),
    _korthi("530B", 128, 20480, 105, 35, 280, 280, 1, 0.560, 0.570, 54.1),
    _korthi("1T", 160, 25600, 128, 64, 512, 512, 1, 0.563, 0.570, 28.7),
)

# --- MT-NLG 530B (Smith et al. 2022) -----------------------------------------------------------
_MTNLG_NOTE = (
    "Global batch 1920, seq 2048, A100 80GB DGX nodes on Selene. The paper reports iteration time "
    "{t} s and {tf} TFLOP/s per GPU; these agree (to 0.5 TFLOP/s) with the Megatron hardware-FLOP formula "
    "96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h)), i.e. recompute counted. tokens/s/GPU = 1920*2048/(t*GPUs) "
    "from the published iteration time. tp8 pp35 per the paper; dp = GPUs/280. Full activation "
    "checkpointing is implied by the FLOP convention (Megatron-DeepSpeed 3D parallel). Not pinned "
    "down: micro-batch size, pipeline schedule (DeepSpeed pipeline engine), ZeRO stage of the data-"
    "parallel axis, and the 16-bit type (bf16 recorded). The data axis is priced as DeepSpeed's pipeline "
    "engine runs it: one all-reduce a step after the last backward, beside no compute. mb = 1920/dp (one "
    "sequence per micro-batch) is NOT from the source, only there so the plan is complete: the micro-batch size "
    "sets the pipeline's bubble, so these rows rest on a number the source does not state (*). Dropout is not "
    "stated; Megatron-DeepSpeed's default, 0.1 on attention and hidden states, is recorded. Vocab: GPT-2 BPE "
    "(50,257); recorded as 51,200, the size Megatron pads it to at tp=8 (multiple of 128*tp). " + _UNTIED
)


def _mtnlg(nodes: int, t: float, tflops: float, tokens: float) -> PublishedRun:
    return PublishedRun(fused_attention=False, fused_qkv=True, data_engine="deepspeed-pipe", checked=False,
        pipe_scatter=True,
        name=f"MT-NLG 530B on {nodes * 8} A100",
        model=_gpt(105, 20480, 128, 51200, 2048, pp=35),
        cluster=f"{nodes * 8}xA100-80GB",
        plan=f"tp8,pp35,mb={1920 * 35 // nodes},ac=full,precision=bf16,sp=off",
        global_batch=1920, seq_len=2048, micro_batch_size=None,
        reported=tflops, unit="tflops_per_gpu_hw", tokens_per_s_per_device=tokens,
        source="https://arxiv.org/abs/2201.11990 section 2 (system throughput at 280/350/420 DGX A100 nodes)",
        note=_MTNLG_NOTE.format(t=t, tf=tflops),
    )


_MTNLG = (
    _mtnlg(280, 60.1, 126, 29.21),
    _mtnlg(350, 50.2, 121, 27.97),
    _mtnlg(420, 44.4, 113, 26.36),
)

# --- BLOOM-176B (BigScience tr11) --------------------------------------------------------------
_BLOOM = PublishedRun(fused_attention=False, fused_qkv=True, data_engine="deepspeed-bf16", pipe_scatter=True,
    name="BLOOM-176B (BigScience tr11) on 384 A100",
    model=ModelConfig(num_layers=70, dim=14336, num_heads=112, ffn_dim=4 * 14336, vocab_size=250880,
                      max_seq_len=2048, norm="layernorm", activation="gelu", pos_emb="rope", bias=True,
                      tie_embeddings=False, dropout=0.1),
    cluster="48x8xA100-80GB-OPA",
    plan="fsdp8,zero=1,tp4,pp12,mb=128,sched=1f1b,ac=full,precision=bf16,reduce=bf16,sp=off",
    global_batch=2048, seq_len=2048, micro_batch_size=2,
    reported=149.77, unit="tflops_per_gpu_hw", tokens_per_s_per_device=104.3,
    source=("https://github.com/bigscience-workshop/bigscience train/tr11-176B-ml/README.md ('Important checkpoints': "
            "iteration 85376 log line, end of epoch one, 2022-06-28) and tr11-176B-ml.slurm; chronicles.md "
            "gives 149-150 TFLOPs at full batch"),
    note=("Megatron-DeepSpeed, 48 nodes x 8 A100 80GB (Jean Zay), each node with 4 Omni-Path 100 Gb/s links, not "
          "a DGX A100's 8 HDR InfiniBand NICs (BLOOM model card, huggingface.co/bigscience/bloom, 'Hardware': '8 "
          "GPUs per node Using NVLink 4 inter-gpu connects, 4 OmniPath links'; recorded as shoal's A100-80GB-OPA "
          "device). Log line: 104.70 s/iteration, 19.561 "
          "samples/s, 149.77 TFLOPs, global batch 2048. tokens/s/GPU = 19.561*2048/384 = 104.3 (from "
          "samples/s directly). The TFLOPs are hardware FLOPs (README 'Throughput': activation "
          "checkpointing, 4*2 coefficient; the exact Megatron eq. 3 with V=250,880 gives 149.76 for "
          "104.70 s). Plan from the slurm script: TP=4, PP=12, DP=8, MBS=2 (so 128 micro-batches per "
          "pipeline per step), --checkpoint-activations, --bf16, BF16_Optimizer = ZeRO stage 1 "
          "(recorded as fsdp8,zero=1, run as DeepSpeed's pipeline engine runs it with its BF16_Optimizer at "
          "ZERO_STAGE=0, README 'Deepspeed config': every micro-batch's gradients added into an fp32 buffer, one "
          "all-reduce of it, cast to bf16 (reduce=bf16: DeepSpeed's communication_data_type at stage 0 with bf16), "
          "and one gather a step, after the last backward, not shoal's FSDP2 gathering every micro-batch; "
          "data_engine deepspeed-bf16); DeepSpeed's pipeline "
          "engine runs a 1F1B-style schedule. Shape: "
          "ALiBi positions (no position parameters; recorded as pos_emb=rope, the parameter-free choice "
          "shoal has) plus an extra embedding LayerNorm; vocab padded to 250,880. Dropout 0.1 on attention and "
          "hidden states: 'The default Megatron-LM dropout settings are inherited' (README, --attention-dropout "
          "0.1, --hidden-dropout 0.1). " + _UNTIED),
)

# --- OPT-175B (Zhang et al. 2022) --------------------------------------------------------------
_OPT = PublishedRun(fused_attention=False, fused_qkv=True,
    name="OPT-175B on 992 A100", checked=False,
    model=ModelConfig(num_layers=96, dim=12288, num_heads=96, ffn_dim=49152, vocab_size=50272,
                      max_seq_len=2048, **_GPT),
    cluster="124x8xA100-80GB",
    plan="fsdp124,zero=2,tp8,ac=full,precision=fp16,sp=off",
    global_batch=992, seq_len=2048, micro_batch_size=8,
    reported=147.0, unit="tflops_per_gpu_hw", tokens_per_s_per_device=102.5,
    source=("https://arxiv.org/abs/2205.01068 section 2.4 ('up to 147 TFLOP/s per GPU', 992 80GB A100, FSDP "
            "with Megatron-LM tensor parallelism); github.com/facebookresearch/metaseq "
            "metaseq/launcher/opt_job_constants.py ('175b': 96 layers, 12288, 96 heads, 2M-token batch, "
            "model parallel 8), opt_baselines.py, projects/OPT/download_opt175b.md (124 hosts, 8x TP)"),
    note=("'Up to' 147 TFLOP/s: a peak, not an average, and the paper does not say which FLOP count it "
          "uses. tokens/s/GPU here assumes the Megatron hardware formula (recompute counted; activation "
          "checkpointing was on): 147e12/(96*l*h^2*(1 + s/(6h) + V/(16*l*h))) = 102.5; with the model-FLOP "
          "formula (72*..., V/(12lh)) it would be 136.6. Plan from the metaseq launcher, not from the "
          "logbook: FSDP with --no-reshard-after-forward (ZeRO-2-like, recorded zero=2) over 124 data "
          "ranks, TP 8, --checkpoint-activations, --memory-efficient-fp16, per-rank batch "
          "(2*1024*1024 // 124) // 2048 = 8 sequences with update-freq 1, so 992 sequences per step. "
          "Tensor parallelism without sequence parallelism (sp=off). Activation is ReLU (recorded as "
          "gelu: same two matrices); learned positions, tied embeddings."),
)

# --- Llama 3 405B (Llama 3 Herd of Models, 2024) -----------------------------------------------
_LLAMA3_SRC = "https://arxiv.org/abs/2407.21783 section 3.3.2, Table 4 (scaling configurations and MFU)"
_LLAMA3_NOTE = (
    "Grand Teton, H100 80GB HBM3 at 700 W, RoCE. The table gives GPUs, TP, CP, PP, DP, sequence length, "
    "batch size per DP group, tokens per batch (16M), TFLOPs/GPU ({tf}) and BF16 MFU ({mfu}). "
    "These table values were recalled from the paper and not re-read in this session: check them "
    "against the PDF. The paper does not give its FLOP formula; tokens/s/GPU here = {tf}e12 / "
    "flops_per_token, with PaLM's 6N + 12*L*H*Dh*T (shoal's ModelConfig.flops_per_token, N = "
    "non-embedding parameters + output projection) = {fpt:.3f} TFLOP/token. DP is FSDP that "
    "shards optimizer state and gradients but does not reshard parameters after forward (recorded "
    "zero=2). Not given: micro-batch size and count, the virtual-stage count of their modified "
    "interleaved schedule (sched is left out), activation recompute (ac left out), what its sequence "
    "parallelism keeps (priced as DTensor keeps it, tp_engine left out). mb={mb} (one "
    "sequence per micro-batch, all the DP group's sequences) is NOT from the paper: it is there only so "
    "the plan is complete; micro_batch_size is None."
)


def _llama3(gpus: int, cp: int, dp: int, seq: int, batch: int, tflops: float, mfu: float, fpt: float,
            tokens: float) -> PublishedRun:
    axes = f"fsdp{dp},zero=2,tp8,pp16,mb={batch // dp}" + (f",cp{cp}" if cp > 1 else "")
    return PublishedRun(
        name=f"Llama 3 405B pre-training on {gpus} H100, seq {seq}", checked=False,
        model=PRESETS["llama3-405b"].replace(max_seq_len=seq),
        cluster=f"{gpus}xH100-80GB",
        plan=axes + ",precision=bf16",
        global_batch=batch, seq_len=seq, micro_batch_size=None,
        reported=mfu, unit="mfu", tokens_per_s_per_device=tokens,
        source=_LLAMA3_SRC, note=_LLAMA3_NOTE.format(tf=tflops, mfu=f"{mfu:.0%}", fpt=fpt, mb=batch // dp),
    )


_LLAMA3 = (
    _llama3(8192, 1, 64, 8192, 64 * 32, 430, 0.43, 2.625, 163.8),
    _llama3(16384, 1, 128, 8192, 128 * 16, 400, 0.41, 2.625, 152.4),
    _llama3(16384, 16, 8, 131072, 8 * 16, 380, 0.38, 5.670, 67.0),
)

# --- torchtitan (Liang et al. 2024, arXiv 2410.06511) -------------------------------------------
_TT_HW = ("Grand Teton: 8 H100 per host with NVLink, 96GB HBM2e H100s at the default 500 W limit (not the "
          "80GB/700 W SXM part; recorded as shoal's H100-96GB-500W device), 400 Gb/s RDMA per GPU. ")
_TT_SEQ = ("Sequence length is not in the table; 8192 is seq_len in torchtitan's llama3 8B/70B/405B "
           "train_configs at the benchmarked commit. ")
_TT_2412 = ("https://github.com/pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (formerly "
            "docs/performance.md, torchtitan 9dec370, torch 1963fc8, 2024-12); same tables in "
            "arXiv 2410.06511")
_TT_2506 = ("https://github.com/pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md "
            "(torchtitan 820504e, 2025-06), 'Vanilla TP' column, bf16 row")

_TORCHTITAN = (
    PublishedRun(
        name="torchtitan Llama 3.1 8B, FSDP on 8 H100",
        selective_policy="torchtitan-op", model=PRESETS["llama3-8b"], cluster="8xH100-96GB-500W",
        plan="fsdp8,ac=selective,precision=bf16,compile=off",
        global_batch=16, seq_len=8192, micro_batch_size=2,
        reported=5762, unit="tokens_per_s_per_gpu", tokens_per_s_per_device=5762,
        source=_TT_2412 + ", Table 1 row 'FSDP'",
        note=_TT_HW + _TT_SEQ + "Local batch 2, global 16, selective AC, bf16, no torch.compile. "
             "The page says 1D 8B without Float8 reaches 33-39% MFU (against the SXM peak).",
    ),
    PublishedRun(
        name="torchtitan Llama 3.1 8B, FSDP + compile on 8 H100",
        selective_policy="torchtitan-op", model=PRESETS["llama3-8b"], cluster="8xH100-96GB-500W",
        plan="fsdp8,ac=selective,precision=bf16,compile=on",
        global_batch=16, seq_len=8192, micro_batch_size=2,
        reported=6667, unit="tokens_per_s_per_gpu", tokens_per_s_per_device=6667,
        source=_TT_2412 + ", Table 1 row 'FSDP + torch.compile'",
        note=_TT_HW + _TT_SEQ + "Local batch 2, global 16, selective AC, bf16, torch.compile.",
    ),
    PublishedRun(
        name="torchtitan Llama 3.1 8B, FSDP + compile on 128 H100",
        selective_policy="torchtitan-op", model=PRESETS["llama3-8b"], cluster="128xH100-96GB-500W",
        plan="fsdp128,ac=selective,precision=bf16,compile=on",
        global_batch=256, seq_len=8192, micro_batch_size=2,
        reported=6514, unit="tokens_per_s_per_gpu", tokens_per_s_per_device=6514,
        source=_TT_2412 + ", Table 3 row 'FSDP + torch.compile'",
        note=_TT_HW + _TT_SEQ + "Local batch 2, global 256, selective AC, bf16, torch.compile "
             "(5,605 tokens/s/GPU without compile).",
    ),
    PublishedRun(
        name="torchtitan Llama 3.1 8B, FSDP8 x TP8 + compile on 64 H100",
        selective_policy="torchtitan-op", model=PRESETS["llama3-8b"], cluster="64xH100-96GB-500W",
        plan="fsdp8,tp8,ac=selective,precision=bf16,compile=on",
        global_batch=96, seq_len=8192, micro_batch_size=12,
        reported=4378, unit="tokens_per_s_per_gpu", tokens_per_s_per_device=4378,
        source=_TT_2506,
        note=_TT_HW + _TT_SEQ + "FSDP=8, TP=8 (torchtitan TP is sequence-parallel), torch.compile, "
             "per-op selective AC, local batch 12 (global = 12 x 8 FSDP ranks = 96), bf16, synchronous "
             "TP (4,809 with async TP).",
    ),
    PublishedRun(
        name="torchtitan Llama 3.1 70B, FSDP32 x TP8 + compile on 256 H100",
        model=PRESETS["llama3-70b"], cluster="256xH100-96GB-500W",
        plan="fsdp32,tp8,ac=full,precision=bf16,compile=on",
        global_batch=512, seq_len=8192, micro_batch_size=16,
        reported=597.3, unit="tokens_per_s_per_gpu", tokens_per_s_per_device=597.3,
        source=_TT_2506,
        note=_TT_HW + _TT_SEQ + "FSDP=32, TP=8, torch.compile, full AC, local batch 16 (global 512), "
             "bf16, synchronous TP (652.4 with async TP; 829 with Float8 + async TP in the 2024-12 "
             "Table 4).",
    ),
    PublishedRun(
        unsharded_accumulation=True,
        name="torchtitan Llama 3.1 405B, FSDP8 x TP8 x PP8 (1F1B, Float8) on 512 H100", checked=False,
        model=PRESETS["llama3-405b"], cluster="512xH100-96GB-500W",
        plan="fsdp8,tp8,pp8,mb=8,sched=1f1b,ac=full,precision=bf16,compile=on",
        global_batch=256, seq_len=8192, micro_batch_size=None,
        reported=100, unit="tokens_per_s_per_gpu", tokens_per_s_per_device=100,
        source=_TT_2412 + ", Table 5 row '1F1B'",
        note=_TT_HW + _TT_SEQ + "Float8 linears (torchao) + async TP + torch.compile, full AC, local "
             "batch 32, global 256. shoal has no float8, so precision=bf16 is recorded: expect the "
             "published number to beat a bf16 prediction. Micro-batch count is not stated; mb=8 is "
             "torchtitan's default at that commit (pipeline_parallel_microbatches None -> pp degree), "
             "so 4 sequences per micro-batch if not overridden.",
    ),
    PublishedRun(
        unsharded_accumulation=True,
        name="torchtitan Llama 3.1 405B, FSDP8 x TP8 x PP8 (interleaved 1F1B, Float8) on 512 H100", checked=False,
        model=PRESETS["llama3-405b"], cluster="512xH100-96GB-500W",
        plan="fsdp8,tp8,pp8,mb=8,sched=interleaved,vpp=2,ac=full,precision=bf16,compile=on",
        global_batch=256, seq_len=8192, micro_batch_size=None,
        reported=128, unit="tokens_per_s_per_gpu", tokens_per_s_per_device=128,
        source=_TT_2412 + ", Table 5 row 'Interleaved 1F1B'",
        note=_TT_HW + _TT_SEQ + "As the 1F1B row, with Interleaved1F1B; vpp=2 and mb=8 are torchtitan's "
             "code defaults at that commit (2 stages per rank for looped schedules; micro-batches = pp "
             "degree), not stated in the table. Float8 recorded as bf16 (see the 1F1B row).",
    ),
)

_BRIDGE_2509 = ("https://github.com/NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md (commit 00b7660b), "
                "section '25.09 NeMo Container', table 'System: DGX-H100', row 'DeepSeekV3 (dropless)'; also "
                "https://docs.nvidia.com/nemo/megatron-bridge/latest/performance-summary-archive.html")

_DEEPSEEK_V3 = PublishedRun(
    tp_engine="megatron", pipe_scatter=True, checked=False,
    name="Megatron-Bridge DeepSeek-V3, TP2 x PP8 (VP4) x EP64 on 1024 H100",
    model=PRESETS["deepseek-v3"], cluster="1024xH100-80GB",
    plan="dp64,tp2,pp8,ep64,mb=128,sched=interleaved,vpp=4,precision=bf16",
    global_batch=8192, seq_len=4096, micro_batch_size=1,
    reported=1297, unit="tokens_per_s_per_gpu", tokens_per_s_per_device=1297,
    source=_BRIDGE_2509,
    note="1024 GPUs, GBS 8192, MBS 1, sequence 4096, FSDP 0 (DDP), TP 2, PP 8, CP 1, VP 4, EP 64, GA 128: "
         "1297 tokens/s/GPU, 338 model TFLOP/s/GPU (330 with 128x128 weight / 1x128 activation fp8 blocks, the "
         "table's footnote). Dropless, the tokens force-balanced among the experts (footnote). The 25.09 table has "
         "no precision column: bf16 is recorded, not read (the later tables, which have one, hold no H100 "
         "DeepSeek-V3 row), hence checked=False. How the run ran, from the release branch of that container "
         "(r0.1.0, 68c25f591: scripts/performance/run_script.py, configs/deepseek/deepseek_v3_llm_pretrain.yaml, "
         "src/megatron/bridge/recipes/deepseek/deepseek_v3.py): on H100 DeepEP (moe_token_dispatcher_type flex, "
         "each token sent once per destination node across InfiniBand, then over NVLink), "
         "moe_router_force_load_balancing, the expert all-to-all overlapped with another micro-batch's compute "
         "(overlap_moe_expert_parallel_comm, delay_wgrad_compute), selective recompute of the modules mla_up_proj "
         "and mlp, sequence parallelism with expert tensor parallelism 1 (each tensor-parallel rank dispatches "
         "its own sequence shard), the pipeline layout Et|(tt|)*30mL (one multi-token-prediction layer, "
         "mtp_num_layers 1, in the last virtual stage, which the preset leaves out), the distributed optimizer "
         "with bf16 moments, overlap_grad_reduce off. Of these the plan records none (shoal has no DeepEP, no "
         "all-to-all overlap, no MTP, and its ac=selective is its own policy): the breakdown in "
         "docs/planner_at_scale.md prices each. DDP is recorded as dp64; EP 64 within the 64-way data axis, as "
         "Megatron-Core lays expert parallelism over the data ranks.",
)

PUBLISHED: tuple[PublishedRun, ...] = (
    *_MEGATRON21, *_KORTHIKANTI, *_MTNLG, _BLOOM, _OPT, *_LLAMA3, *_TORCHTITAN, _DEEPSEEK_V3,
)
