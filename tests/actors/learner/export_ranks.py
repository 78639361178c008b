"""One rank of a 2-rank FSDP learner group for tests/actors/learner/test_streamed_export.py (a real
process, gloo).

    python export_ranks.py RANK WORLD INIT_FILE OUT_DIR

For each variant of VARIANTS: a sharded Learner, one train step on this rank's shard of a batch,
then (every rank: collectives) the policy's logits on IDS (rank 0 writes OUT_DIR/VARIANT.logits.pt),
the streamed export to OUT_DIR/VARIANT.hf (files of at most the variant's max_shard_bytes), a DCP
checkpoint to OUT_DIR/VARIANT.ckpt, and the gathered weights (OUT_DIR/VARIANT.weights.safetensors)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from fsdp_ranks import batch, config  # noqa: E402

# variant -> max_shard_bytes of its export: "plain" in several files (an index), "lora" in one
VARIANTS = {"plain": 40_000, "lora": 5 * 2**30}
IDS = torch.randint(8, 264, (2, 10), generator=torch.Generator().manual_seed(5))


def main(rank: int, world: int, init_file: str, out: Path) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    from postrain.actors.learner import fsdp
    from postrain.actors.learner.group import shard_batch
    from postrain.actors.learner.learner import Learner, LearnerConfig
    from postrain.actors.learner.streamed_export import export_sharded

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
    for variant, max_shard_bytes in VARIANTS.items():
        learner = Learner(LearnerConfig(**config(variant), seed=rank))
        assert learner.sharded
        learner.train_step(shard_batch(batch(0), world)[rank])
        with torch.no_grad():
            logits = learner.model(IDS)
        fsdp.reshard(learner.model)
        export_sharded(learner.model, learner.lora, learner.tokenizer, learner.policy_version, learner.comm,
                       out / f"{variant}.hf", max_shard_bytes=max_shard_bytes, base_model=learner.config.model)
        learner.save_checkpoint(out / f"{variant}.ckpt")
        weights = learner.state_dict()
        if rank == 0:
            torch.save(logits, out / f"{variant}.logits.pt")
            save_file({k: v.contiguous() for k, v in weights.items()}, str(out / f"{variant}.weights.safetensors"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
