"""`postrain serve --tinker` as a real process, driven by the tinker SDK (cli/serve.py)."""
import argparse
import os
import subprocess
import sys

import pytest
import tinker
from tinker import types


@pytest.fixture
def server():
    env = {**os.environ, "POSTRAIN_API_KEY": ""}
    process = subprocess.Popen([sys.executable, "-m", "postrain.cli", "serve", "--tinker", "--model", "tiny",
                                "--port", "0", "--api-key", "tml-cli-test"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = process.stdout.readline()     # printed once serving: waits on the process, not on time
        assert "serving the Tinker API (tiny) at http://127.0.0.1:" in line, (line, process.stderr.read())
        yield line.split(" at ")[1].split()[0]
    finally:
        process.terminate()
        process.wait(30)


@pytest.mark.slow
def test_the_served_api_trains_and_samples_through_the_sdk(server):
    client = tinker.ServiceClient(base_url=server, api_key="tml-cli-test")
    tc = client.create_lora_training_client("tiny", rank=2, seed=0, train_unembed=False).result()
    tokens = [1, 5, 9, 40, 77]
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 4})
    before = tc.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = tc.forward([datum], "cross_entropy").result().metrics["loss:sum"]
    assert after < before
    sampler = tc.save_weights_and_get_sampling_client().result()
    out = sampler.sample(types.ModelInput.from_ints(tokens), 2, types.SamplingParams(max_tokens=3)).result()
    assert [len(s.tokens) <= 3 for s in out.sequences] == [True, True]
    client.close("success").result(timeout=30)


@pytest.mark.parametrize("argv, message", [
    (["--api-key", "secret"], "only sends an API key that starts with 'tml-'"),
    (["--host", "0.0.0.0"], "clients must send an API key"),
    (["--max-training-clients-per-base", "0"], "--max-training-clients-per-base 0: Input should be greater than"),
    (["--evict-after-s", "soon"], "want seconds (a number >= 0) or 'never'"),
    (["--sandbox-workers", "0"], "--sandbox-workers 0: Input should be greater than or equal to 1"),
])
def test_a_key_the_sdk_cannot_send_an_open_host_without_one_or_a_bad_limit_is_refused(argv, message):
    env = {**os.environ, "POSTRAIN_API_KEY": ""}
    done = subprocess.run([sys.executable, "-m", "postrain.cli", "serve", "--tinker", *argv], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 2 and message in done.stderr


def test_the_sandbox_and_cache_flags_set_the_servers_options():
    from postrain.cli import serve
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    default = serve.tinker_options(parser.parse_args(["--tinker"]))
    assert (default.enable_sandbox, default.sandbox_workers, default.sandbox_max_timeout_s,
            default.kv_cache_mb) == (True, 2, 60.0, 64.0)
    options = serve.tinker_options(parser.parse_args(["--tinker", "--no-sandbox", "--sandbox-workers", "3",
                                                      "--sandbox-max-timeout-s", "5", "--sandbox-memory-mb", "256",
                                                      "--kv-cache-mb", "128"]))
    assert (options.enable_sandbox, options.sandbox_workers, options.sandbox_max_timeout_s,
            options.sandbox_memory_mb, options.kv_cache_mb) == (False, 3, 5.0, 256, 128.0)
