"""One rank of an FSDP learner group for tests/actors/learner/test_learner_fsdp.py (a real process, gloo).

    python fsdp_ranks.py RANK WORLD INIT_FILE OUT_DIR VARIANT[,VARIANT...] [save | resume=CKPT]

For each variant: a Learner with strategy "fsdp" over the group, 3 train steps on this rank's
shard of the batches, then (every rank: collectives) its gathered weights, written by rank 0
to OUT_DIR/VARIANT.safetensors, and this rank's measured bytes to OUT_DIR/VARIANT.rank<R>.json.
`save`: the first variant's learner also writes its gathered AdamW moments to
OUT_DIR/VARIANT.moments.safetensors and a DCP checkpoint to OUT_DIR/ckpt. `resume=CKPT`: no
training; the first variant loads CKPT two ways (`resume_both_ways`) and writes the same files.
Variants in PUBLISHED then publish twice and export (`publish_rounds`)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from postrain.actors.records import TrainBatch

TINY = dict(vocab_size=264, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
# lr = adam_eps = 1: a weight moves by about g / (|g| + 1), so weights show gradient differences
# directly (tests/actors/learner/test_learner_dp.py says why).
CONFIG = dict(model=TINY, lr=1.0, adam_eps=1.0, micro_batch_size=2, agg_mode="seq-mean-token-mean",
              max_grad_norm=0.5, strategy="fsdp")
VARIANTS = {
    "prefix": dict(shared_prefix=True),
    "plain_ac": dict(shared_prefix=False, activation_checkpointing=True),
    "prefix_ac": dict(shared_prefix=True, activation_checkpointing=True),
    "plain": dict(shared_prefix=False),
    "lora": dict(shared_prefix=True, lora={"rank": 4, "alpha": 8}),
    "exact": dict(shared_prefix=True, exact=True),
}
STEPS = 3
PUBLISHED = ("prefix", "lora")      # variants whose publishes (and export) are checked


def config(variant: str) -> dict:
    return {**CONFIG, **VARIANTS[variant]}


def batch(step: int, num: int = 8) -> TrainBatch:
    """Groups of 4 samples that share a 5-token prompt (shared-prefix training runs on each rank)."""
    g = torch.Generator().manual_seed(100 + step)
    prompts = [torch.randint(8, 264, (5,), generator=g) for _ in range(num // 4)]
    ids = [torch.cat([prompts[i // 4], torch.randint(8, 264, (3 + 2 * (i % 5),), generator=g)])
           for i in range(num)]
    return TrainBatch(token_ids=ids, loss_mask=[[0] * 5 + [1] * (len(x) - 5) for x in ids],
                      behavior_logprobs=[torch.randn(len(x), generator=g) * 0.1 - 5.5 for x in ids],
                      policy_versions=[step] * num, advantages=torch.randn(num, generator=g).tolist())


def main(rank: int, world: int, init_file: str, out: Path, variants: list[str], save: bool = False,
         resume: str | None = None) -> None:
    import torch.distributed as dist

    from postrain.actors.learner.group import shard_batch
    from postrain.actors.learner.learner import Learner, LearnerConfig

    torch.set_num_threads(1)
    if resume:
        return resume_both_ways(rank, world, init_file, out, variants[0], resume)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
    for index, variant in enumerate(variants):
        learner = Learner(LearnerConfig(**config(variant), seed=rank))   # rank 0's weights broadcast
        assert learner.sharded
        metrics = [learner.train_step(shard_batch(batch(step), world)[rank]) for step in range(STEPS)]
        held = {**learner.held_bytes(), "grads": learner.grad_bytes, "loss": metrics[-1]["loss"]}
        (out / f"{variant}.rank{rank}.json").write_text(json.dumps(held))
        write_gathered(learner, rank, out, variant, moments=save and index == 0)
        if save and index == 0:
            learner.save_checkpoint(out / "ckpt", extra={"variant": variant})
        if variant in PUBLISHED:                # after the checkpoint: it trains one more step
            publish_rounds(learner, rank, world, out, variant)
        if learner.config.exact:
            exact_round(learner, rank, world, out, variant)
    dist.destroy_process_group()


def exact_round(learner, rank: int, world: int, out: Path, variant: str) -> None:
    """Every rank samples 8 continuations from an exact engine on the gathered weights (the same
    samples on every rank: seeded), then scores its shard as the sharded exact learner; writes
    OUT_DIR/VARIANT.exact.rank<R>.json: the largest |recorded - recomputed| and the step's gap."""
    from postrain.actors.generator.engine import Engine
    from postrain.actors.generator.sampling import SamplingParams
    from postrain.actors.learner.group import shard_batch

    import torch.distributed as dist

    held = [learner.state_dict()]                            # a collective: every rank gathers, rank 0 keeps
    dist.broadcast_object_list(held, src=0)
    weights = held[0]
    engine = Engine(type(learner.model).empty(learner.model.config), None, num_blocks=64, exact=True)
    engine.load_weights(weights, learner.policy_version)
    prompts = [[20, 21, 22, 23, 24], [40, 41, 42]]
    outs = engine.generate(prompts, SamplingParams(n=4, seed=3, max_new_tokens=10, ignore_eos=True))
    samples = [(p, s) for p, o in zip(prompts, outs) for s in o.outputs]
    whole = TrainBatch(token_ids=[p + s.token_ids for p, s in samples],
                       loss_mask=[[0] * len(p) + [1] * len(s.token_ids) for p, s in samples],
                       behavior_logprobs=[[0.0] * len(p) + s.logprobs for p, s in samples],
                       policy_versions=[learner.policy_version] * len(samples), advantages=[1.0, -1.0] * 4)
    mine = shard_batch(whole, world)[rank]
    gap = max(float((got - torch.tensor(want, dtype=torch.float64).float()).abs()[torch.tensor(m, dtype=torch.bool)].max())
              for got, want, m in zip(learner.compute_logprobs(mine), mine.behavior_logprobs, mine.loss_mask))
    step_gap = learner.train_step(mine)["logprob_gap_max"]
    (out / f"{variant}.exact.rank{rank}.json").write_text(json.dumps({"gap": gap, "step_gap": step_gap}))


def resume_both_ways(rank: int, world: int, init_file: str, out: Path, variant: str, checkpoint: str) -> None:
    """Load `checkpoint` as the learner actor does (resume_from: whole tensors before the group
    forms, then sharded) into OUT_DIR/VARIANT.*, and into a learner already sharded in the group
    into OUT_DIR/VARIANT_ingroup.*."""
    import torch.distributed as dist

    from postrain.actors.learner.learner import Learner, LearnerConfig

    before = Learner(LearnerConfig(**config(variant), seed=rank))
    before.load_checkpoint(checkpoint)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
    before.join_process_group()
    assert before.sharded
    write_gathered(before, rank, out, variant, moments=True)
    inside = Learner(LearnerConfig(**config(variant), seed=rank))
    inside.load_checkpoint(checkpoint)
    write_gathered(inside, rank, out, f"{variant}_ingroup", moments=True)
    dist.destroy_process_group()


def write_gathered(learner, rank: int, out: Path, name: str, moments: bool) -> None:
    """Every rank gathers; rank 0 writes OUT_DIR/NAME.safetensors (weights) and, with `moments`,
    OUT_DIR/NAME.moments.safetensors (AdamW's state by "<index>.<name>")."""
    from safetensors.torch import save_file

    weights = learner.state_dict()
    state = gathered_moments(learner) if moments else None
    if rank == 0:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(out / f"{name}.safetensors"))
        if state is not None:
            save_file(state, str(out / f"{name}.moments.safetensors"))


def publish_rounds(learner, rank: int, world: int, out: Path, variant: str) -> None:
    """Two publishes in weight_sync "delta" (a full sync, then a step and a patch: changed elements,
    or LoRA's adapters) to a receiver on rank 0 that resolves them as a generator does; then an
    export. Rank 0 writes OUT_DIR/VARIANT.publish.json: per round, patch or not, its tensor bytes,
    and whether the receiver's digest equals the plan's and the learner's gathered weights'."""
    from safetensors.torch import load_file

    from postrain.actors.learner.group import shard_batch
    from postrain.actors.weights.messages import weights_digest
    from postrain.actors.weights.sync_plan import SyncPlanner, tensor_bytes
    from postrain.actors.records import WeightSync
    from postrain.actors.weights.patch import WeightPatcher

    planner, patcher = SyncPlanner("delta", learner.lora), WeightPatcher()
    held, held_version, rounds = {}, None, []
    for round_ in range(2):
        if round_:
            learner.train_step(shard_batch(batch(STEPS + 10), world)[rank])
        plan = planner.prepare(learner.base_weights(), learner.policy_version)                  # every rank gathers; rank 0 keeps
        whole = learner.state_dict()
        if rank == 0:
            message = plan.message_for("gen0")
            sync = WeightSync.from_wire(message)
            got = patcher.resolve(sync, dict(sync.weights), held_version, lambda: held)
            rounds.append({"patch": plan.is_patch(message), "bytes": tensor_bytes(message.weights),
                           "digest_ok": weights_digest(got) == plan.digest == weights_digest(whole)})
            plan.sent("gen0", message)
            held, held_version = got, plan.version
        plan.finish()
    learner.export_hf(out / f"{variant}.hf")
    if rank == 0:
        exported = load_file(str(out / f"{variant}.hf" / "model.safetensors"))
        report = {"rounds": rounds, "export_ok": weights_digest(exported) == weights_digest(whole)}
        (out / f"{variant}.publish.json").write_text(json.dumps(report))


def gathered_moments(learner) -> dict[str, torch.Tensor]:
    """AdamW's state of every parameter, whole ("<index>.<name>"; a collective under FSDP)."""
    from postrain.actors.learner.fsdp import full_tensor

    state = learner.optimizer.state_dict()["state"]
    return {f"{i}.{name}": full_tensor(v).detach().clone() for i, entry in state.items() for name, v in entry.items()}


if __name__ == "__main__":
    mode = sys.argv[6] if len(sys.argv) > 6 else ""
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), sys.argv[5].split(","),
         save=mode == "save", resume=mode.split("=", 1)[1] if mode.startswith("resume=") else None)
