"""docs/your-model.md end to end, command by command as the page writes them, in a fresh folder
holding a random tiny model laid out as a folder from the Hub (tests/actors/models/hf_tiny.py): the
download is the one step stood in for. Qwen3's run (its no-thinking template, `--dry-run` with the
sizing, the short run, export, serve and one chat completion) is CI's; Llama's, the same commands
with `llama` for `qwen3`, is the `arch_matrix` marker's (about 40 s more), with its config made and
sized by the page's `sed` in CI."""
import os
import re
import shlex
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "your-model.md").read_text()
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
FOLDERS = {"qwen3": "Qwen3-0.6B", "llama": "Llama-3.2-1B-Instruct"}   # as the page downloads them

sys.path.insert(0, str(ROOT / "tests" / "actors" / "models"))
from hf_tiny import save_hf_folder  # noqa: E402  (tests/actors/models/hf_tiny.py)


def block(needle: str) -> str:
    """The one fenced block of the page whose text holds `needle`."""
    (text,) = [m.group(2) for m in FENCE.finditer(PAGE) if needle in m.group(2)]
    return text


def line(needle: str, arch: str = "qwen3") -> str:
    """The page's one shell line that is `needle`, or else holds it, for `arch` (the page's words for
    a Llama)."""
    lines = [text for m in FENCE.finditer(PAGE) if m.group(1) == "bash" for text in m.group(2).splitlines()]
    (found,) = [text for text in lines if text == needle] or [text for text in lines if needle in text]
    return found if arch == "qwen3" else found.replace("qwen3", arch).replace(FOLDERS["qwen3"], FOLDERS[arch])


def argv(command: str) -> list[str]:
    """A documented `postrain ...` line as this interpreter runs it."""
    words = shlex.split(command, comments=True)
    assert words[0] == "postrain", command
    return [sys.executable, "-m", "postrain.cli", *words[1:]]


def run(command: str, cwd: Path, timeout: int = 180) -> subprocess.CompletedProcess:
    result = subprocess.run(argv(command), capture_output=True, text=True, cwd=cwd, timeout=timeout)
    assert result.returncode == 0, f"`{command}` failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def user_folder(home: Path, arch: str) -> Path:
    """A user's folder after the page's download (a tiny random model in models/), with the run
    config written as the page gives it (Qwen3: with no_think.jinja made by the page's script;
    Llama: llama.toml made from it by the page's `sed`)."""
    save_hf_folder(home / "models" / FOLDERS[arch], arch, template_file=arch == "llama")
    if arch == "qwen3":
        script = block("no_think.jinja\", \"w\")")
        subprocess.run([sys.executable, "-c", script], cwd=home, check=True, timeout=120)
    (home / "qwen3.toml").write_text(block("# qwen3.toml: GRPO with LoRA"))
    if arch == "llama":
        subprocess.run(["bash", "-c", line("sed -e")], cwd=home, check=True, timeout=30)
    return home


def test_the_config_is_the_one_the_page_shows_and_a_llama_one_comes_from_it(tmp_path):
    home = user_folder(tmp_path, "llama")
    qwen3, llama = (tomllib.loads((home / f"{name}.toml").read_text()) for name in ("qwen3", "llama"))
    assert qwen3["shared"]["chat_template"] == "no_think.jinja" and "chat_template" not in llama["shared"]
    assert (llama["run"]["name"], llama["shared"]["model"]) == ("llama", "models/Llama-3.2-1B-Instruct")
    assert qwen3["actors"] == llama["actors"]
    checked = run(line("postrain up --config qwen3.toml --dry-run", "llama"), home)
    assert "postrain up: sized from models/Llama-3.2-1B-Instruct" in checked.stdout
    assert "postrain up: llama.toml -> 4 actors" in checked.stdout


@pytest.mark.slow
@pytest.mark.variants   # the page's config is checked above; its run to a chat completion takes ~40 s
@pytest.mark.parametrize("arch", ["qwen3", pytest.param("llama", marks=pytest.mark.arch_matrix)])
def test_the_page_runs_from_the_folder_to_a_chat_completion(arch, tmp_path, capsys):
    home = user_folder(tmp_path, arch)
    run(line("postrain generate --model", arch), home)
    sized = run(line("postrain up --config qwen3.toml --dry-run", arch), home).stdout
    assert f"sized from models/{FOLDERS[arch]}" in sized and "generator: kv_cache_mb " in sized
    assert "RL step at the caps: this CPU (1 thread, measured): " in sized and "H100 SXM" in sized
    overridden = run(line("--set learner.memory_mb=6144", arch), home).stdout
    assert "learner: memory_mb 6144 (set)" in overridden and "kv_cache_mb 512 (set)" in overridden
    short = run(line("--set orchestrator.num_steps=2", arch), home, timeout=300).stdout
    assert "step 2/2" in short and "held-out accuracy after RL" in short
    run(line("postrain export runs/", arch), home)
    policy = home / f"{arch}-policy"
    assert (policy / "config.json").is_file() and (policy / "adapter" / "adapter_config.json").is_file()
    chat_completion(line("postrain serve", arch), block("client.chat.completions").replace("qwen3", arch), home)
    assert capsys.readouterr().out.strip(), "the served policy answered nothing"


def chat_completion(serve: str, client_code: str, home: Path) -> None:
    """Start the documented `postrain serve` line (on a free port instead of 8000), run the page's
    client code against it once it says it serves, and stop it with Ctrl-C's signal."""
    from postrain.core.transport import free_tcp_port

    port = str(free_tcp_port("127.0.0.1"))
    server = subprocess.Popen(argv(serve.replace("8000", port)), cwd=home, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        said = ""
        for said in server.stdout:      # its lines until it serves (or ends)
            if said.startswith("serving "):
                break
        served = serve.split("--model ")[1].split()[0]
        assert said.startswith(f"serving {served} at http://127.0.0.1:{port}/v1"), said
        exec(compile(client_code.replace("8000", port), "docs/your-model.md", "exec"), {})
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
