"""examples/slurm/postrain.sbatch: bash parses it, and the run config it writes (its Slurm
variables filled in) is a valid `postrain up` config that places on three nodes named by address."""
from __future__ import annotations

import re
import string
import subprocess
from pathlib import Path

from postrain.cli.config import load_up_config
from postrain.core.cluster import ClusterScheduler, NodeInventory
from postrain.core.scheduler import Inventory

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "slurm" / "postrain.sbatch"


def test_bash_parses_the_script():
    result = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_embedded_run_config_loads_and_places_on_three_nodes(tmp_path):
    body = re.search(r'cat > "\$config" <<EOF\n(.*?)\nEOF\n', SCRIPT.read_text(), re.S).group(1)
    text = string.Template(body).substitute(SLURM_JOB_ID="42", RUN_DIR=str(tmp_path), address="10.0.0.1:6379",
                                            head_ip="10.0.0.1")
    (tmp_path / "run.toml").write_text(text)
    config = load_up_config(tmp_path / "run.toml")
    assert config.cluster.address == "10.0.0.1:6379" and config.run.name == "slurm-42"
    nodes = [NodeInventory(f"10.0.0.{i}", f"10.0.0.{i}", Inventory(cpu_ids=tuple(range(16)), memory_mb=65536))
             for i in (1, 2, 3)]
    groups = {name: group for group, names in config.replica_groups().items() for name in names}
    where = {p.name: p.node for p in ClusterScheduler(nodes).plan(config.actors, groups)}
    assert where["learner"] == where["orchestrator"] == "10.0.0.1"
    assert where["generator-0"] != where["generator-1"]          # spread
    driver = next(spec for spec in config.actors if spec.name == "orchestrator")
    assert driver.options["generators"] == ["generator-0", "generator-1"]
    assert driver.options["envs"] == ["env-0", "env-1"]
