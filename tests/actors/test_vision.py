"""Images in: broken images refused by name, the engine's image path (greedy equal to a plain forward,
one tower run per image, prefix caching and preemption unchanged), the learner's logprobs equal to
the engine's on image-and-text samples, and the tower frozen unless `train_vision`.

The built-in `tiny-vl` (models/config.py: the tiny text model and the patch tower, random weights)
on charts of the `charts` task.
"""
from __future__ import annotations

import dataclasses
import io
import json
import os
import struct
import sys
import zlib

import pytest
import torch

from postrain.actors.generator.engine import Engine, EngineError
from postrain.actors.generator.sampling import SamplingParams
from postrain.actors.learner.batch import LearnerError, pack_batch
from postrain.actors.learner.learner import Learner, LearnerConfig
from postrain.actors.models.loading import load_model
from postrain.actors.records import TrainBatch
from postrain.actors.models.images import ImageInputError, load_image, render_prompt
from postrain.actors.models.vision import ImageRows
from postrain.actors.tasks.charts import Chart, chart_message, data_url, eval_tasks, render_png
from postrain.bench.vision_folders import run_requests

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # tests/actors
from train_batches import assert_logprobs_equal, sampled_batch  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_vl():
    return load_model("tiny-vl")


@pytest.fixture(scope="module")
def prompts(tiny_vl):
    """Two chart prompts: (ids, images) each, rendered with the model's image layout."""
    model, tokenizer = tiny_vl
    return [render_prompt(tokenizer, model.vision.layout, [chart_message(task, "image")])
            for task in eval_tasks({"num_eval": 2})]


def png_with_size(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height (its pixel data is a stub: refused before decoding)."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = lambda kind, data: (struct.pack(">I", len(data)) + kind + data
                                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b"")


def reference_greedy(model, ids: list[int], images: list[bytes], steps: int = 8) -> list[int]:
    """Greedy tokens by plain full forwards, the images spliced over the prompt's placeholders."""
    rows = model.vision.encode_images(images)
    prompt_mask = torch.tensor(ids) == model.vision.image_token_id
    out = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            mask = torch.cat([prompt_mask, torch.zeros(len(out) - len(ids), dtype=torch.bool)])[None]
            logits = model(torch.tensor([out]), images=ImageRows(rows, mask))
            out.append(int(logits[0, -1].argmax()))
    return out[len(ids):]


# ------------------------------------------------------------------ broken input


def test_broken_images_are_refused_with_what_was_wrong():
    png = render_png(Chart.from_dict(eval_tasks({"num_eval": 1})[0]["chart"]))
    assert load_image(png).size == (448, 336)
    with pytest.raises(ImageInputError, match="0 bytes"):
        load_image(b"")
    with pytest.raises(ImageInputError, match="does not decode completely"):
        load_image(png[:len(png) // 2])
    with pytest.raises(ImageInputError, match="400000000 pixels.*downscale it"):
        load_image(png_with_size(20000, 20000))
    with pytest.raises(ImageInputError, match="10000 x 9000 pixels.*downscale it"):
        load_image(png_with_size(10000, 9000))
    tiff = io.BytesIO()
    load_image(png).save(tiff, format="TIFF")
    with pytest.raises(ImageInputError, match="TIFF is not supported"):
        load_image(tiff.getvalue())
    with pytest.raises(ImageInputError, match="not an image file"):
        load_image(b"%PDF-1.4 not an image")
    with pytest.raises(ImageInputError, match="data URL"):
        load_image("http://example.com/chart.png")


def test_an_image_for_a_text_only_model_is_refused(prompts):
    model, tokenizer = load_model("tiny")
    message = chart_message(eval_tasks({"num_eval": 1})[0], "image")
    with pytest.raises(ImageInputError, match="reads text only"):
        render_prompt(tokenizer, None, [message])
    ids, images = prompts[0]
    with pytest.raises(EngineError, match="reads text only"):
        Engine(model, tokenizer).add_request(ids, GREEDY, images=images)


def test_a_request_whose_images_do_not_fill_its_placeholders_is_refused_and_the_engine_goes_on(tiny_vl, prompts):
    model, tokenizer = tiny_vl
    (ids, images), _ = prompts
    engine = Engine(model, tokenizer)
    with pytest.raises(EngineError, match="image placeholder tokens"):
        engine.add_request(ids, GREEDY, images=images * 2)
    with pytest.raises(ImageInputError, match="does not decode"):
        engine.add_request(ids, GREEDY, images=[images[0][:100]])
    (out,) = run_requests(engine, [(ids, images, GREEDY)])
    assert out.outputs[0].token_ids == reference_greedy(model, ids, images)


# ------------------------------------------------------------------ the engine


def test_an_image_that_fails_in_the_tower_fails_its_request_alone(tiny_vl, prompts, monkeypatch):
    """The engine encodes the images of the requests added since its last step together; when the
    tower raises on one, that request is aborted and named, and the others run as they would."""
    model, tokenizer = tiny_vl
    (ids_a, images_a), (ids_b, images_b) = prompts
    bad = model.vision.layout.pixel_values(load_image(images_b[0]))
    real = model.vision.encode_many

    def failing(pixel_values):
        if any(torch.equal(values, bad) for values in pixel_values):
            raise RuntimeError("out of memory")
        return real(pixel_values)
    monkeypatch.setattr(model.vision, "encode_many", failing)
    engine = Engine(model, tokenizer)
    good = engine.add_request(ids_a, GREEDY, images=images_a)
    doomed = engine.add_request(ids_b, GREEDY, images=images_b)
    with pytest.raises(EngineError, match=f"the image of request {doomed} failed in the vision tower .RuntimeError: "
                                          "out of memory.; 1 request.s. aborted"):
        engine.step()
    assert engine.stats()["num_image_encodes"] == 1           # the good image, read again alone
    outputs = {}
    while engine.has_unfinished():
        outputs.update((out.request_id, out) for out in engine.step())
    assert list(outputs) == [good]
    assert outputs[good].outputs[0].token_ids == reference_greedy(model, ids_a, images_a)


@pytest.mark.parametrize("chunk", [0, 16])
def test_greedy_with_an_image_equals_a_plain_forward_and_each_image_is_encoded_once(tiny_vl, prompts, chunk):
    model, tokenizer = tiny_vl
    (ids_a, images_a), (ids_b, images_b) = prompts
    expected_a, expected_b = reference_greedy(model, ids_a, images_a), reference_greedy(model, ids_b, images_b)
    engine = Engine(model, tokenizer, prefill_chunk_tokens=chunk)
    group, other = run_requests(engine, [(ids_a, images_a, SamplingParams(n=8, temperature=0.0, max_new_tokens=8,
                                                                          ignore_eos=True)),
                                         (ids_b, images_b, GREEDY)])
    assert [s.token_ids for s in group.outputs] == [expected_a] * 8
    assert other.outputs[0].token_ids == expected_b
    assert engine.stats()["num_image_encodes"] == 2          # a group of 8 on one image: one tower run
    assert engine.image_encoder is not None and engine.image_encoder.tower_calls == 1   # both images in one call
    (again,) = run_requests(engine, [(ids_a, images_a, GREEDY)])
    assert again.outputs[0].token_ids == expected_a
    assert again.num_cached_prompt_tokens == (len(ids_a) - 1) // 8 * 8   # the prefix cache held it
    assert engine.stats()["num_image_encodes"] == 2
    # the same ids with the other chart: the prefix cache must not hand back the first chart's KV
    (swapped,) = run_requests(engine, [(ids_a, images_b, GREEDY)])
    assert swapped.outputs[0].token_ids == reference_greedy(model, ids_a, images_b)
    common = next(i for i, (a, b) in enumerate(zip(ids_a, ids_b)) if a != b)   # shared with request b only
    assert 0 < swapped.num_cached_prompt_tokens <= common


def test_preemption_keeps_greedy_output_with_images(tiny_vl, prompts):
    model, tokenizer = tiny_vl
    (ids, images), _ = prompts
    expected = reference_greedy(model, ids, images, steps=24)
    params = SamplingParams(n=4, temperature=0.0, max_new_tokens=24, ignore_eos=True)
    blocks = -(-len(ids) // 8) + 6           # room for the prompt and a few samples' tails, not all four
    engine = Engine(model, tokenizer, num_blocks=blocks, block_size_tokens=8)
    (out,) = run_requests(engine, [(ids, images, params)])
    assert engine.stats()["num_preemptions"] > 0
    assert [s.token_ids for s in out.outputs] == [expected] * 4


# ------------------------------------------------------------------ the learner


def with_images(batch, images):
    return dataclasses.replace(batch, images=images)


@pytest.mark.parametrize("shared_prefix", [True, False])
def test_learner_logprobs_equal_the_engines_on_image_and_text_samples(prompts, shared_prefix):
    """Three groups of 3: chart A, chart B, and chart B under A's ids (the same tokens, other
    pixels). With shared prefixes each group's prompt, its image included, runs once, and the
    third group never borrows the first's prefix."""
    learner = Learner(LearnerConfig(model="tiny-vl", micro_batch_size=9, lr=1e-3, shared_prefix=shared_prefix))
    model, tokenizer = load_model("tiny-vl")
    model.load_state_dict(learner.model.state_dict())
    engine = Engine(model, tokenizer)
    (ids_a, images_a), (ids_b, images_b) = prompts
    groups = [(ids_a, images_a), (ids_b, images_b), (ids_a, images_b)]
    requests = [(ids, images, SamplingParams(n=3, temperature=1.0, max_new_tokens=10, seed=3, ignore_eos=True))
                for ids, images in groups]
    outs = run_requests(engine, requests)
    batch = sampled_batch([ids for ids, _ in groups], outs, reward=lambda i: float(i == 0))
    batch = with_images(batch, [images for _, images in groups for _ in range(3)])
    _, micro = learner.forward.micro_batches(pack_batch(batch, advantages=torch.zeros(9)))
    plans = [mb.shared for mb in micro]
    assert (plans[0] is not None and plans[0].batch.prefix_ids.shape[0] == 3) if shared_prefix else plans == [None]
    mine = learner.compute_logprobs(batch)
    assert_logprobs_equal(mine, batch)
    tower = {k: v.clone() for k, v in learner.model.vision.state_dict().items()}
    text = learner.model.model.layers[0].mlp.up_proj.weight.clone()
    metrics = learner.train_step(batch)
    assert metrics["logprob_gap_max"] < 1e-4
    assert not torch.equal(learner.model.model.layers[0].mlp.up_proj.weight, text)
    assert all(torch.equal(v, tower[k]) for k, v in learner.model.vision.state_dict().items()), \
        "the tower is frozen by default"
    doubled = [images * 2 for _, images in groups for _ in range(3)]     # more images than placeholder runs
    with pytest.raises(LearnerError, match="image placeholders"):
        learner.compute_logprobs(with_images(batch, doubled))


def test_train_vision_moves_the_tower(prompts):
    learner = Learner(LearnerConfig(model="tiny-vl", micro_batch_size=4, lr=1e-3, train_vision=True))
    model, tokenizer = load_model("tiny-vl")
    model.load_state_dict(learner.model.state_dict())
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=1, ignore_eos=True)
    outs = run_requests(Engine(model, tokenizer), [(ids, images, params) for ids, images in prompts])
    batch = sampled_batch([ids for ids, _ in prompts], outs, reward=lambda i: float(i == 0))
    batch = with_images(batch, [images for _, images in prompts for _ in range(2)])
    before = learner.model.vision.patch_embed.weight.clone()
    learner.train_step(batch)
    assert not torch.equal(learner.model.vision.patch_embed.weight, before)


def test_a_train_batch_whose_images_were_lost_is_refused(prompts):
    learner = Learner(LearnerConfig(model="tiny-vl", micro_batch_size=4))
    (ids, images), _ = prompts
    batch = TrainBatch(token_ids=[ids + [65, 66]], loss_mask=[[0] * len(ids) + [1, 1]],
                       behavior_logprobs=[[0.0] * (len(ids) + 2)], advantages=[1.0])
    with pytest.raises(LearnerError, match="prompt holds 48 image placeholders but its 0 image"):
        learner.train_step(batch)
    assert learner.train_step(dataclasses.replace(batch, images=[images]))["num_tokens"] == 2


def test_postrain_generate_shows_an_image_file_and_answers_as_the_model_does(tiny_vl, tmp_path, capsys):
    from postrain.cli.main import main

    model, tokenizer = tiny_vl
    png = render_png(Chart.from_dict(eval_tasks({"num_eval": 1})[0]["chart"]))
    (tmp_path / "chart.png").write_bytes(png)
    argv = ["generate", "--model", "tiny-vl", "--image", str(tmp_path / "chart.png"), "--prompt", "Revenue in Q3?",
            "--temperature", "0", "--max-tokens", "8", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    message = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png)}},
                                           {"type": "text", "text": "Revenue in Q3?"}]}
    ids, images = render_prompt(tokenizer, model.vision.layout, [message])
    assert out["prompt_token_ids"] == ids and out["stats"]["num_image_encodes"] == 1
    assert out["samples"][0]["token_ids"] == reference_greedy(model, ids, images)
    (tmp_path / "cut.png").write_bytes(png[:200])
    assert main(argv[:4] + [str(tmp_path / "cut.png")] + argv[5:]) == 2
    assert "does not decode completely" in capsys.readouterr().err
    assert main(["generate", "--model", "tiny"] + argv[3:]) == 2
    assert "reads text only" in capsys.readouterr().err


def test_a_demonstration_with_an_image_becomes_an_sft_sample_with_its_image(tiny_vl):
    from postrain.actors import get_task
    from postrain.actors.orchestrator.warm_start import chat_to_sample
    from postrain.actors.tasks.demonstrations import DemonstrationError

    model, tokenizer = tiny_vl
    demo = get_task("charts").demonstrations(1, seed=0)[0]
    ids, mask, images = chat_to_sample(tokenizer, model.vision.layout, demo["messages"])
    run = [i for i, token in enumerate(ids) if token == model.vision.image_token_id]
    assert len(run) == 48 and run == list(range(run[0], run[0] + 48)) and not any(mask[i] for i in run)
    assert tokenizer.decode([t for t, m in zip(ids, mask) if m]).startswith(demo["messages"][-1]["content"])
    assert load_image(images[0]).size == (448, 336)
    with pytest.raises(DemonstrationError, match="reads text only"):
        chat_to_sample(tokenizer, None, demo["messages"])
