"""`postrain export RUN_OR_CHECKPOINT OUT`: a run's policy as a Hugging Face folder, or its LoRA adapter.

    postrain export runs/default policy-hf/              # the run's checkpoint, merged weights
    postrain export runs/default/checkpoint policy-hf/   # the same, naming the checkpoint folder
    postrain export --peft runs/lora_run adapter/        # a LoRA run's PEFT adapter folder alone

RUN_OR_CHECKPOINT is a run folder (run_dir/name, where `postrain up` wrote config.toml; its
learner checkpoint is RUN_FOLDER/checkpoint, the run's latest, replaced at each save) or a
learner checkpoint folder itself, whole or sharded (`strategy = "fsdp"`: one shard per rank, in
any number of ranks).

Without --peft, OUT holds config.json, the tokenizer and the weights (LoRA merged) as
safetensors, in files of at most --max-shard-gb each with transformers' index past that, and
for a LoRA run also the PEFT adapter in OUT/adapter; it is read and written one decoder layer at
a time, so the model never has to fit this machine's memory whole. With --peft, OUT is the PEFT
adapter folder alone (adapter_config.json, adapter_model.safetensors) that
`peft.PeftModel.from_pretrained(base_model, OUT)` loads over the run's base model.
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path

HELP = "write a run's policy as a Hugging Face folder, or its LoRA adapter (`postrain export RUN OUT`)"
RUN_CONFIG = "config.toml"      # what marks a run folder (cli/run_folder.py writes it first)
RUN_CHECKPOINT = "checkpoint"   # a run's learner checkpoint, in its run folder (actors/orchestrator/driver.py)


def add_arguments(parser) -> None:
    parser.add_argument("source", metavar="RUN_OR_CHECKPOINT",
                        help="a run folder (run_dir/name: its checkpoint/) or a learner checkpoint folder "
                        "(RUN_FOLDER/checkpoint)")
    parser.add_argument("out", metavar="OUT", help="the folder to write (replaced atomically if it exists)")
    parser.add_argument("--peft", action="store_true",
                        help="write the LoRA adapter as a PEFT adapter folder instead of the merged policy")
    parser.add_argument("--max-shard-gb", type=float, default=5.0,
                        help="largest safetensors file of the merged policy, in GiB (default 5, transformers')")


def checkpoint_of(source: Path) -> tuple[Path, Path | None]:
    """(the learner checkpoint, its run folder or None) that `source` names: a run folder (it
    holds RUN_CONFIG) gives its RUN_CHECKPOINT; any other folder is the checkpoint itself, whose
    run folder is its parent when that holds RUN_CONFIG."""
    if (source / RUN_CONFIG).is_file():
        return source / RUN_CHECKPOINT, source
    return source, source.parent if (source.parent / RUN_CONFIG).is_file() else None


def next_steps(out: Path, run: Path | None, peft: bool) -> str:
    """What to run on the folder written, as lines that work as printed."""
    folder = shlex.quote(str(out))
    if peft:
        base = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
        base = repr(base) if base else "BASE"      # None: the run's model was a dict of config fields
        return ("load it over the run's base model with\n  peft.PeftModel.from_pretrained("
                f"transformers.AutoModelForCausalLM.from_pretrained({base}), {str(out)!r})")
    lines = [f"postrain generate --model {folder} --prompt 'Hello'",
             f"postrain serve --model {folder}"]
    if run is not None:
        lines.append(f"postrain eval {shlex.quote(str(run))} --model {folder}   # on the run's task and options")
    return "try it:\n" + "".join(f"  {line}\n" for line in lines).rstrip("\n")


def main(args) -> int:
    from postrain.actors.learner.lora import ADAPTER_FOLDER
    from postrain.actors.learner.streamed_export import export_checkpoint, export_peft_checkpoint
    from postrain.core.errors import PostrainError

    if not args.max_shard_gb > 0:
        raise SystemExit(f"postrain export: --max-shard-gb must be > 0, got {args.max_shard_gb}")
    checkpoint, run = checkpoint_of(Path(args.source))
    try:
        if args.peft:
            folder = export_peft_checkpoint(checkpoint, args.out)
        else:
            folder = export_checkpoint(checkpoint, args.out, max_shard_bytes=int(args.max_shard_gb * 2**30))
    except PostrainError as exc:
        raise SystemExit(f"postrain export: {exc}") from None
    if args.peft:
        what = "a PEFT adapter folder"
    else:
        adapter = folder / ADAPTER_FOLDER
        what = "a Hugging Face folder" + (f" (LoRA merged; its PEFT adapter in {adapter})" if adapter.is_dir() else "")
    print(f"postrain export: wrote {folder}, {what} of {checkpoint}; {next_steps(folder, run, args.peft)}")
    return 0
