"""Low-rank adapters (shoal.models.lora): the layer against its formula, the settings' grammar and refusals,
frozen bases with no gradient and no optimizer state, and parity with one process under every axis.

Tolerances: the layer's check compares one float64 formula evaluated in two orders (1e-12 relative is far above
their roundings and far below any missing term). The parallel runs use check_parity's yardsticks
(shoal/testing/parity.py): the float32 run's own distance from the float64 run.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch
from torch import nn

from shoal.models import build_model
from shoal.models.lora import LoRALinear, apply_lora, is_adapter, trainable_share
from shoal.models.lora_config import LoRAConfig, adapted_params, adapter_params
from shoal.testing.parity import HF_FAMILIES, SMALL, ParityCase, check_parity, run_parallel

LORA = LoRAConfig(r=4, alpha=8.0, init_b_std=0.02)
"""Adapters on all seven projections; B drawn (not zeros) so that A's first gradients are not zero."""


def lora_model(cfg: Any = SMALL, lora: LoRAConfig = LORA, dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return apply_lora(build_model(cfg).to(dtype), lora)


def test_layer_is_its_formula():
    model = lora_model()
    layer = model.layers["0"].attention.wq
    assert isinstance(layer, LoRALinear)
    x = torch.randn(3, 5, layer.in_features, dtype=torch.float64)
    want = x @ layer.weight.T + (LORA.alpha / LORA.r) * (x @ layer.lora_A.T) @ layer.lora_B.T
    if layer.bias is not None:
        want = want + layer.bias
    torch.testing.assert_close(layer(x), want, rtol=1e-12, atol=1e-12)


def test_frozen_base_and_counts():
    model = lora_model()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter(n) for n in trainable)
    assert len(trainable) == 2 * 7 * SMALL.num_layers
    train, _ = trainable_share(model)
    assert train == adapter_params(SMALL, LORA)
    adapted = sum(p.numel() for n, p in model.named_parameters() if n.endswith("weight") and
                  n.rsplit(".", 1)[0] + ".lora_A" in dict(model.named_parameters()))
    assert adapted == adapted_params(SMALL, LORA)


def test_starts_equal_to_base_with_zero_b():
    tokens = torch.randint(0, SMALL.vocab_size, (2, 8))
    torch.manual_seed(0)
    base = build_model(SMALL).double()
    adapted = lora_model(lora=LoRAConfig(r=4))
    torch.testing.assert_close(adapted(tokens), base(tokens), rtol=0, atol=0)


def test_frozen_weights_get_no_gradient_and_no_optimizer_state():
    from shoal.optim.builder import build_optimizer
    from shoal.optim.config import OptimConfig

    model = lora_model(dtype=torch.float32)
    optimizer = build_optimizer(model.parameters(), OptimConfig())
    model(torch.randint(0, SMALL.vocab_size, (2, 8))).sum().backward()
    optimizer.step()
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for name, p in model.named_parameters():
        assert (id(p) in held) == is_adapter(name), name
        assert (p.grad is not None) == is_adapter(name), name
    assert all(id(p) in held for p in optimizer.state)


@pytest.mark.parametrize(("text", "match"), [
    ("r=0", "r=0 is not valid"), ("alpha=-1", "alpha=-1 is not valid"), ("dropout=1", "dropout=1 is not valid"),
    ("targets=q,x", "targets=x is not valid"), ("rank=4", "key 'rank' is not valid"), ("r=four", "r takes"),
    ("q", "'q' is not key=value"),
])
def test_bad_settings_one_line(text, match):
    with pytest.raises(ValueError, match=match) as info:
        LoRAConfig.parse(text)
    assert "\n" not in str(info.value)


def test_parse_round_trip():
    cfg = LoRAConfig.parse("r=16,alpha=32,dropout=0.05,targets=q,k,v,o,gate,up,down")
    assert (cfg.r, cfg.alpha, cfg.dropout, len(cfg.targets)) == (16, 32.0, 0.05, 7)
    assert LoRAConfig.parse(cfg.text()) == cfg
    assert LoRAConfig.parse("r=8,targets=q,v").targets == ("q", "v")


# ----------------------------------------------------------------------------- parity


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoRACase(ParityCase):
    """A parity case whose model carries adapters (its base frozen): what every plan trains is the adapters."""

    lora: LoRAConfig = LORA

    def build_model(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        torch.manual_seed(self.seed)
        return apply_lora(build_model(self.model).to(dtype), self.lora, seed=self.seed)

    def optimizer(self, params: Any) -> torch.optim.Optimizer:
        return super().optimizer([p for p in params if p.requires_grad])


MOE = SMALL.replace(num_experts=4, top_k=2, ffn_dim=64)
QWEN2 = HF_FAMILIES["qwen2"]
"""Tied embeddings (frozen: the tied table's two copies under pp and its vocabulary-parallel split under tp) and
biases on q, k and v (frozen beside their adapters)."""
ATTENTION = dataclasses.replace(LORA, targets=("q", "k", "v", "o"))
TWO = [LoRACase(plan=p) for p in ("dp2", "fsdp2,zero=1", "fsdp2,zero=2", "fsdp2", "tp2", "tp2,sp=off", "cp2",
                                  "dp2,ac=full", "tp2,ac=selective")] + [
    LoRACase(plan="pp2,mb=2", num_micro=2)] + [
    LoRACase(plan=p, model=MOE, lora=ATTENTION, steps=3) for p in ("ep2", "tp2", "fsdp2,ep2")] + [
    LoRACase(plan=p, model=QWEN2, steps=2, num_micro=2 if p.startswith("pp") else 1)
    for p in ("tp2", "fsdp2", "pp2,mb=2")]


def run_cases(cases):
    return [run_parallel(c) for c in cases]


def _check_all(results, cases):
    for i, c in enumerate(cases):
        rank_results = [r[i] for r in results]
        assert all(is_adapter(n) for res in rank_results for n in res["grads"]), c.plan
        check_parity(rank_results, c)


def test_parity_two_processes(pools):
    """dp2, fsdp2 at zero 1/2/3, tp2 (with and without sequence parallelism), cp2, full and selective recompute,
    pp2; ep2, tp2 and fsdp2,ep2 on an MoE model (adapters on attention, the experts frozen); Qwen2's shape under
    tp2, fsdp2 and pp2: logits, every adapter's first-step gradient, the first step, the losses of the steps and
    the final adapters against one process (check_parity)."""
    _check_all(pools(2).run(run_cases, TWO), TWO)


FOUR = [LoRACase(plan="fsdp2,tp2"), LoRACase(plan="tp2,pp2,mb=2", num_micro=2)]


def test_parity_four_processes(pools):
    """fsdp2 over tp2 and tp2 with pp2."""
    _check_all(pools(4).run(run_cases, FOUR), FOUR)


COMPILED = [LoRACase(plan="dp2,compile=on", steps=2)]


def test_parity_compiled(pools):
    """compile=on (each block compiled) with adapters: the same checks as above."""
    _check_all(pools(2).run(run_cases, COMPILED), COMPILED)


def _placements(plan_text):
    from shoal.testing.parity import parallel_setup

    runtime, _, _ = parallel_setup(LoRACase(plan=plan_text))
    return {n: str(p.placements) for n, p in runtime.named_parameters() if n.startswith("layers.0.")}


def test_tp_splits_adapters_along_their_layers_features(pools):
    """Column-parallel layers (q, k, v, gate, up) split B (out, r) on dim 0 and replicate A; row-parallel ones
    (o, down) split A (r, in) on dim 1 and replicate B: each rank computes its own output features (or its partial
    sum) as the split base weight does, with no extra collective in forward."""
    got = pools(2).run(_placements, "tp2")[0]
    for leaf in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
        assert got[f"layers.0.{leaf}.lora_B"] == "(Shard(dim=0),)", leaf
        assert got[f"layers.0.{leaf}.lora_A"] == "(Replicate(),)", leaf
    for leaf in ("attention.wo", "feed_forward.w2"):
        assert got[f"layers.0.{leaf}.lora_A"] == "(Shard(dim=1),)", leaf
        assert got[f"layers.0.{leaf}.lora_B"] == "(Replicate(),)", leaf


# ----------------------------------------------------------------------------- the command line

SMALL_RUN = ["--device", "cpu", "--set", "num_layers=2", "--set", "dim=32", "--set", "ffn_dim=64", "--global-batch",
             "4", "--seq-len", "16", "--eval-batches", "1", "--eval-every", "0"]


@pytest.mark.parametrize(("argv", "names"), [
    (["--lora", "r=0"], ["--lora r=0", "valid"]),
    (["--lora", "r=4,dropout=0.1", "--plan", "tp2"], ["--lora dropout=0.1 under tp=2", "dropout=0"]),
    (["--lora", "r=4,dropout=0.1", "--plan", "cp2"], ["cp=2", "dropout=0"]),
    (["--lora", "r=4,base=int8", "--model", "tiny-moe"], ["experts' matrices", "q,k,v,o"]),
])
def test_bad_lora_flags_one_line(capsys, tmp_path, argv, names):
    from shoal.testing.asserts import assert_user_error

    assert_user_error(capsys, ["train", "--out", str(tmp_path / "run"), *SMALL_RUN, *argv], *names)
    assert not (tmp_path / "run").exists()


def test_train_with_lora_from_a_config_file(tmp_path):
    """`lora = "..."` in a TOML config trains adapters only (one process, 2 steps): the run folder records it,
    and the loss moves."""
    import json

    from shoal import cli

    config = tmp_path / "run.toml"
    config.write_text('lora = "r=4,alpha=8,targets=q,v"\n')
    run = tmp_path / "run"
    assert cli.main(["train", "--config", str(config), "--out", str(run), "--steps", "2", "--nproc", "1",
                     *SMALL_RUN]) == 0
    assert 'lora = "r=4,alpha=8,targets=q,v"' in (run / "config.toml").read_text()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["loss"] > 0 for r in records)


# ----------------------------------------------------------------------------- memory


def test_adapter_count_hand_computed_for_llama3_8b():
    """llama3-8b (D 4096, 8 KV heads of 128, F 14336, 32 blocks) at r=16 on all seven projections: per block
    16 x ((4096 + 4096) q + 2 (4096 + 1024) k, v + (4096 + 4096) o + 3 (4096 + 14336) gate, up, down)
    = 16 x 81920 = 1310720; x 32 = 41943040, 0.60% of the 6.98e9 parameters they adapt."""
    from shoal.models.config import get_preset

    cfg, lora = get_preset("llama3-8b"), LoRAConfig(r=16)
    assert adapter_params(cfg, lora) == 41943040
    assert adapter_params(cfg, lora) / adapted_params(cfg, lora) == pytest.approx(0.006, abs=5e-4)


@pytest.mark.parametrize("plan_text", ["fsdp8", "dp8", "tp8"])
def test_planner_prices_adapter_states_at_their_share(plan_text):
    """`shoal plan` for llama3-8b LoRA r=16: the optimizer state and the gradients are the adapters' alone (12
    bytes a parameter in fp32 Adam, sharded as the plan shards them); a frozen base keeps its parameters."""
    from shoal import rules
    from shoal.models.config import get_preset
    from shoal.models.lora_config import adapter_elements_per_rank
    from shoal.plan import Plan
    from shoal.planner.cluster_file import parse_cluster
    from shoal.planner.estimate import Workload, estimate

    cfg, lora = get_preset("llama3-8b"), LoRAConfig(r=16)
    cluster = parse_cluster("8xH100")
    plan = rules.resolve(Plan.parse(plan_text + ",precision=fp32"), world_size=8, device="cuda")
    full = estimate(plan, Workload(model=cfg, global_batch=64, seq_len=2048), cluster)
    adapted = estimate(plan, Workload(model=cfg, global_batch=64, seq_len=2048, lora=lora), cluster)
    shards = 8 if plan.fsdp > 1 else 1
    mine = adapter_elements_per_rank(cfg, lora, tp=plan.tp, layers=cfg.num_layers)
    assert adapted.memory["optimizer"] == pytest.approx(8 * mine / shards, rel=1e-9)
    assert adapted.gradient_bytes == pytest.approx(4 * mine / (shards if plan.zero >= 2 else 1), rel=1e-9)
    assert adapted.memory["parameters"] == pytest.approx(full.memory["parameters"] + 4 * mine / (
        shards if plan.zero >= 3 else 1), rel=1e-9)
    if plan.tp == 1:  # the share r (in + out) / (in x out) of what a full fine-tune holds, less the tables and norms
        share = adapter_params(cfg, lora) / cfg.num_params()
        assert adapted.memory["optimizer"] / full.memory["optimizer"] == pytest.approx(share, rel=1e-6)


def test_lora_step_weight_flops_hand_computed_for_llama3_8b():
    """llama3-8b, per token. Its weight products' forward: per block 2 x (q, o 4096 x 4096, k, v 4096 x 1024, gate,
    up, down 4096 x 14336) = 2 x 218103808 = 436207616, x 32 blocks + the head 2 x 4096 x 128256 = 15009316864.
    A full fine-tune's step: 3 x that (forward, input gradient, weight gradient) = 45027950592. LoRA r=16 on all
    seven: every weight frozen, so 2 x 15009316864, plus the adapters' 2 r (in + out) a projection = 2 x 41943040
    = 83886080 forward, 3 x in the step: 30018633728 + 251658240 = 30270291968, 0.6723 of the full step: 2/3 plus
    the adapters' 3 x 83886080 / 45027950592 = 0.56%. Exact: integers well under 2^53."""
    from shoal.models.config import get_preset
    from shoal.planner.compute import adapter_flops, step_weight_flops, weight_flops

    cfg, lora = get_preset("llama3-8b"), LoRAConfig(r=16)
    assert weight_flops(cfg) == 15009316864
    assert adapter_flops(cfg, lora) == 83886080
    assert step_weight_flops(cfg) == 45027950592
    assert step_weight_flops(cfg, lora) == 30270291968
    assert step_weight_flops(cfg, lora) / step_weight_flops(cfg) == pytest.approx(2 / 3 + 251658240 / 45027950592)
    # one block on a tp8 rank: r (in + out / 8) column-parallel, r (in / 8 + out) row-parallel: q and o 4096 + 512,
    # k and v 4096 + 128, gate, up and down 4096 + 1792
    assert adapter_flops(cfg, lora, 0, tp=8) == 2 * 16 * (2 * 4608 + 2 * 4224 + 3 * 5888) == 1130496


def test_planner_prices_a_lora_step():
    """`shoal plan` for llama3-8b LoRA r=16 at fsdp8: the weight products' time is 2/3 of a full fine-tune's (no
    weight gradient), the adapters' products are priced beside (at least their FLOPs at the matmul rate, each
    product at its memory floor where skinnier), attention and elementwise work unchanged, the optimizer steps the
    adapters alone; the step is shorter and MFU is credited with the LoRA step's FLOPs."""
    from shoal import rules
    from shoal.models.config import get_preset
    from shoal.plan import Plan
    from shoal.planner.cluster_file import parse_cluster
    from shoal.planner.compute import adapter_flops
    from shoal.planner.estimate import Workload, estimate

    cfg, lora = get_preset("llama3-8b"), LoRAConfig(r=16)
    cluster = parse_cluster("8xH100")
    plan = rules.resolve(Plan.parse("fsdp8"), world_size=8, device="cuda")
    full = estimate(plan, Workload(model=cfg, global_batch=64, seq_len=4096), cluster)
    adapted = estimate(plan, Workload(model=cfg, global_batch=64, seq_len=4096, lora=lora), cluster)
    assert adapted.time["compute_matmul"] == pytest.approx(2 / 3 * full.time["compute_matmul"], rel=1e-12)
    tokens = adapted.micro_batch * 4096
    floor = 3 * adapter_flops(cfg, lora) * tokens / cluster.device.flops("bf16")
    assert floor <= adapted.time["compute_adapters"] < 0.2 * adapted.time["compute_matmul"]
    assert "compute_adapters" not in full.time
    for term in ("compute_attention", "compute_elementwise"):
        assert adapted.time[term] == full.time[term], term
    assert adapted.time["optimizer"] < 0.01 * full.time["optimizer"]
    assert adapted.step_time_s < full.step_time_s
    per_token = cfg.flops_per_token(4096)  # a full fine-tune's credit: 6N + attention's
    assert adapted.mfu * adapted.step_time_s / (full.mfu * full.step_time_s) == pytest.approx(
        (per_token - 45027950592 + 30270291968) / per_token, rel=1e-12)


@pytest.mark.parametrize("plan_text", ["dp2,fsdp8", "dp16"])
def test_planner_reduces_the_adapters_gradients_alone(plan_text):
    """llama3-8b LoRA r=16 on 2 x 8 H100s: the gradient reductions move the adapters' gradients alone (0.6% of a
    full fine-tune's bytes: what is left is the collectives' latency, DDP's 7 buckets of 25 MB instead of 644), while
    FSDP still gathers the frozen weights in full."""
    from shoal import rules
    from shoal.models.config import get_preset
    from shoal.plan import Plan
    from shoal.planner.cluster_file import parse_cluster
    from shoal.planner.estimate import Workload, estimate

    cfg, cluster = get_preset("llama3-8b"), parse_cluster("2x8xH100")
    plan = rules.resolve(Plan.parse(plan_text), world_size=16, device="cuda")
    full = estimate(plan, Workload(model=cfg, global_batch=64, seq_len=4096), cluster)
    adapted = estimate(plan, Workload(model=cfg, global_batch=64, seq_len=4096, lora=LoRAConfig(r=16)), cluster)
    reductions = [k for k in full.traffic if k in ("dp_allreduce", "fsdp_reduce_scatter")]
    assert reductions
    for term in reductions:
        assert adapted.traffic[term] < 0.05 * full.traffic[term], term
    if "fsdp_all_gather" in full.traffic:
        assert adapted.traffic["fsdp_all_gather"] == full.traffic["fsdp_all_gather"]
    assert adapted.time["dp_sync_exposed"] <= full.time["dp_sync_exposed"]


def _states(text):
    import re

    rows = [line.split() for line in text.splitlines() if re.match(r"\s+[01]\s+\d", line)]
    return [(float(r[2]), float(r[3])) for r in rows]


@pytest.mark.parametrize("plan_text", ["fsdp2", "tp2"])
def test_dry_run_gradient_and_optimizer_memory_is_the_adapters_share(tmp_path, capfd, plan_text):
    """The small preset at r=16 on 2 ranks: the gradients and AdamW state the dry run finds alive are within 10% of
    12 bytes (fp32 gradient, two moments) for each adapter parameter the rank holds (the formula
    r (in + out) per projection, split as fsdp or tp splits it), and the planner prints the same figures."""
    from shoal import cli
    from shoal.models.config import get_preset
    from shoal.models.lora_config import adapter_elements_per_rank

    argv = ["train", "--dry-run", "--nproc", "2", "--plan", plan_text, "--device", "cpu", "--model", "small",
            "--lora", "r=16", "--global-batch", "4", "--seq-len", "64", "--out", str(tmp_path / "run")]
    assert cli.main(argv) == 0
    text = capfd.readouterr().out
    cfg, tp = get_preset("small"), 2 if plan_text == "tp2" else 1
    mine = adapter_elements_per_rank(cfg, LoRAConfig(r=16), tp=tp, layers=cfg.num_layers) / (2 if tp == 1 else 1)
    formula = 12 * mine / 2**20
    for grads, optim in _states(text):
        assert abs(grads + optim - formula) <= 0.1 * formula, (grads, optim, formula)
    import re

    printed = dict(re.findall(r"(gradients|optimizer) ([\d.]+)", text.split("planner, busiest")[1]))
    assert abs(float(printed["gradients"]) + float(printed["optimizer"]) - formula) <= 0.1 * formula
    from shoal.planner.compute import step_weight_flops

    ratio = step_weight_flops(cfg, LoRAConfig(r=16)) / step_weight_flops(cfg)
    assert f"the step's weight products {ratio:.3f} of a full fine-tune's" in text


# ----------------------------------------------------------------------------- checkpoints


def test_checkpoint_holds_adapters_and_reshards(pools, tmp_path):
    """Steps 0-1 under fsdp2, 2-3 under tp2, 4 in one process, each resumed from the last one's checkpoint: the
    losses and gradient norms of an unbroken single-process run, and the final adapters; each checkpoint holds the
    adapters and their optimizer state only (the frozen base is rebuilt from its source)."""
    from torch.distributed.checkpoint import FileSystemReader

    from shoal.testing.asserts import assert_rounding_close
    from shoal.testing.parity import assert_trained_close, references, train_segments
    from shoal.train.checkpoint import latest_checkpoint

    run = LoRACase(steps=5)
    ref32, ref64 = references(run)
    segments = (("fsdp2", 0, 2), ("tp2", 2, 4), ("single", 4, 5))
    for plan_text, start, end, results in train_segments(pools, run, str(tmp_path), segments):
        for rank, res in enumerate(results):
            assert_rounding_close(res["losses"], ref32["losses"][start:end], ref64["losses"][start:end],
                                  what=f"{plan_text} rank {rank} losses of steps {start}..{end - 1}")
            assert_rounding_close(res["grad_norms"], ref32["grad_norms"][start:end], ref64["grad_norms"][start:end],
                                  what=f"{plan_text} rank {rank} gradient norms of steps {start}..{end - 1}")
        saved = FileSystemReader(str(latest_checkpoint(tmp_path))).read_metadata().state_dict_metadata
        models = [k.removeprefix("model.") for k in saved if k.startswith("model.")]
        assert models and all(is_adapter(k) for k in models), [k for k in models if not is_adapter(k)][:3]
    assert_trained_close(results[0]["params"], ref32, ref64)


def test_lora_run_from_init_checkpoints_adapters_and_checks_its_base(tmp_path, capsys):
    """`shoal train --init BASE --lora ...`: the checkpoint holds the adapters (and their optimizer state) only and
    records BASE's path and content hash; a resume reads the base again and continues; a resume after BASE's bytes
    changed is refused in one line."""
    import json

    from torch.distributed.checkpoint import FileSystemReader

    from shoal import cli
    from shoal.apply_plan import parallelize
    from shoal.testing.asserts import assert_user_error
    from shoal.train.checkpoint import latest_checkpoint
    from shoal.train.export import export_model

    base_cfg = SMALL.replace(dim=32, ffn_dim=64, num_heads=4, num_kv_heads=2, vocab_size=256)
    torch.manual_seed(0)
    base = export_model(parallelize(build_model(base_cfg)), tmp_path / "base", hf=True)
    assert base is not None
    run = tmp_path / "run"
    argv = ["--device", "cpu", "--nproc", "1", "--global-batch", "4", "--seq-len", "16", "--eval-every", "0",
            "--eval-batches", "1"]
    assert cli.main(["train", "--init", str(base), "--lora", "r=4,targets=q,v", "--out", str(run), "--steps", "2",
                     *argv]) == 0
    ckpt = latest_checkpoint(run)
    saved = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    names = [k.removeprefix("model.") for k in saved if k.startswith("model.")]
    names += [k.removeprefix("optimizer.state.").rsplit(".", 1)[0] for k in saved if k.startswith("optimizer.state.")]
    assert names and all(is_adapter(n) for n in names), [n for n in names if not is_adapter(n)][:3]
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["lora_base"]["init"] == str(base) and len(state["lora_base"]["sha256"]) == 64
    assert cli.main(["train", "--resume", str(run), "--steps", "3"]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records][-1] == 3
    assert cli.main(["sample", "--run", str(run), "--prompt", "def", "--max-new-tokens", "4"]) == 0  # base + adapters
    weights = base / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # one bit of the last weight
    weights.write_bytes(bytes(data))
    assert_user_error(capsys, ["train", "--resume", str(run), "--steps", "4"], "adapters of the base", "sha256",
                      "the base the run started from")


# ----------------------------------------------------------------------------- peft


def _hf_llama(folder):
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=32,
                                   rms_norm_eps=1e-5, rope_theta=300.0, tie_word_embeddings=False)
    torch.manual_seed(1)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(folder), safe_serialization=True)
    return folder


def exported_logits_agree(base, run, adapter, settings, merged):
    """The three views of a LoRA run agree: peft's PeftModel.from_pretrained(base, adapter), shoal's model with the
    run's latest adapters, and transformers' model of the run's `shoal export --hf` (the adapters merged into the
    base weights), within rtol = atol = 1e-5 in float32 (see the callers), far below the adapters' own effect,
    checked to be over 1e-3. Returns (tokens, peft's logits)."""
    import transformers
    from peft import PeftModel

    from shoal import cli
    from shoal.models.hf_folder import from_hf
    from shoal.train.checkpoint import latest_checkpoint
    from shoal.train.peft_io import checkpoint_adapters

    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    auto = transformers.AutoModelForCausalLM
    hf_base = auto.from_pretrained(str(base), dtype=torch.float32)
    with torch.no_grad():
        base_logits = hf_base.eval()(tokens).logits
        peft_logits = PeftModel.from_pretrained(hf_base, str(adapter)).eval()(tokens).logits
    ours = apply_lora(from_hf(base), LoRAConfig.parse(settings))
    ours.load_state_dict(checkpoint_adapters(latest_checkpoint(run)), strict=False)
    with torch.no_grad():
        shoal_logits = ours.eval()(tokens)
    assert (peft_logits - base_logits).abs().max() > 1e-3  # the adapters change the model
    torch.testing.assert_close(peft_logits, shoal_logits, rtol=1e-5, atol=1e-5)
    # the merge's W + scale B A rounds once more in float32: the same tolerance
    assert cli.main(["export", "--run", str(run), "--out", str(merged), "--hf"]) == 0
    with torch.no_grad():
        merged_logits = auto.from_pretrained(str(merged), dtype=torch.float32).eval()(tokens).logits
    torch.testing.assert_close(merged_logits, peft_logits, rtol=1e-5, atol=1e-5)
    return tokens, peft_logits


def test_peft_loads_the_exported_adapter_and_transformers_the_merged_model(tmp_path):
    """A tiny Hugging Face Llama made here, 3 steps of `shoal train --init it --lora ...` (lr high enough that the
    adapters move the logits), `shoal export --lora-adapter DIR`: peft's PeftModel.from_pretrained(base, DIR) gives
    the logits of shoal's model with the same adapters, and `shoal export --hf` the merged model's. Tolerance
    rtol = atol = 1e-5 in float32, as tests/test_hf_weights.py's for the base alone (the same numbers in another
    order: rotate_half against interleaved pairs, the adapter's two products)."""
    from shoal import cli
    from shoal.train.checkpoint import latest_checkpoint
    from shoal.train.peft_io import checkpoint_adapters

    base = _hf_llama(tmp_path / "base")
    run, adapter = tmp_path / "run", tmp_path / "adapter"
    settings = "r=4,alpha=8,targets=q,k,v,o,gate,up,down"
    assert cli.main(["train", "--init", str(base), "--lora", settings, "--out", str(run), "--steps", "3", "--lr",
                     "0.05", "--warmup-steps", "0", "--device", "cpu", "--nproc", "1", "--global-batch", "4",
                     "--seq-len", "16", "--eval-every", "0", "--eval-batches", "1"]) == 0
    (adapter / "stale.txt").parent.mkdir()
    (adapter / "stale.txt").write_text("an older export")
    assert cli.main(["export", "--run", str(run), "--lora-adapter", str(adapter)]) == 2  # exists: refused
    assert cli.main(["export", "--run", str(run), "--lora-adapter", str(adapter), "--force"]) == 0
    assert not (adapter / "stale.txt").exists()  # replaced whole, not merged into
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and set(config["target_modules"]) == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}

    exported_logits_agree(base, run, adapter, settings, tmp_path / "merged")

    # `shoal train --init ADAPTER`: the adapters continue from the folder's, on the base it names. One step at lr
    # 1e-9 moves an AdamW entry by at most ~1e-9: the checkpoint's adapters are the folder's within 1e-7.
    again = tmp_path / "again"
    assert cli.main(["train", "--init", str(adapter), "--out", str(again), "--steps", "1", "--lr", "1e-9",
                     "--warmup-steps", "0", "--device", "cpu", "--nproc", "1", "--global-batch", "4", "--seq-len",
                     "16", "--eval-every", "0", "--eval-batches", "1"]) == 0
    before, after = checkpoint_adapters(latest_checkpoint(run)), checkpoint_adapters(latest_checkpoint(again))
    assert set(before) == set(after)
    for name in before:
        torch.testing.assert_close(after[name], before[name], rtol=0, atol=1e-7)
    assert 'lora = "r=4,alpha=8' in (again / "config.toml").read_text()


# ----------------------------------------------------------------------------- refusals of the other commands


def test_plan_prints_the_adapters_share_and_refuses_bad_settings(capsys):
    from shoal import cli
    from shoal.testing.asserts import assert_user_error

    assert cli.main(["plan", "--model", "llama3-8b", "--cluster", "8xH100", "--plan", "fsdp8", "--lora", "r=16"]) == 0
    out = capsys.readouterr().out
    assert "41.9M trainable parameters, 0.60% of the 6.98B they adapt" in out and "--lora r=16" in out
    assert "the step's weight products 0.672 of a full fine-tune's" in out
    assert_user_error(capsys, ["plan", "--model", "llama3-8b", "--lora", "r=16,targets=x"], "targets=x", "valid")
    assert_user_error(capsys, ["plan", "--model", "tiny-moe", "--lora", "r=4,dropout=0.1"], "experts' matrices",
                      "q,k,v,o")


def test_export_refusals_one_line(capsys, tmp_path):
    """--lora-adapter of a run that trained every weight, and neither --out nor --lora-adapter."""
    from shoal import cli
    from shoal.testing.asserts import assert_user_error

    run = tmp_path / "run"
    assert cli.main(["train", "--out", str(run), "--steps", "1", "--nproc", "1", *SMALL_RUN]) == 0
    assert_user_error(capsys, ["export", "--run", str(run)], "--out PATH", "--lora-adapter DIR")
    assert_user_error(capsys, ["export", "--run", str(run), "--lora-adapter", str(tmp_path / "a")],
                      "is not of a LoRA run", "--lora-adapter")
    assert not (tmp_path / "a").exists()


def test_peft_folder_refusals_one_line(tmp_path):
    from shoal.train.peft_io import read_peft_config

    folder = tmp_path / "adapter"
    folder.mkdir()
    good = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
            "base_model_name_or_path": str(tmp_path)}
    for change, words in [({"base_model_name_or_path": "org/remote-model"}, "is not a local folder"),
                          ({"target_modules": ["c_attn"]}, "target_modules c_attn"),
                          ({"use_dora": True}, "DoRA")]:
        (folder / "adapter_config.json").write_text(json.dumps({**good, **change}))
        with pytest.raises(ValueError, match=words) as info:
            read_peft_config(folder)
        assert "\n" not in str(info.value)
    (folder / "adapter_config.json").write_text(json.dumps(good))
    lora, base = read_peft_config(folder)
    assert (lora.r, lora.alpha, lora.targets, base) == (4, 8.0, ("q",), str(tmp_path))
