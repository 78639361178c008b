"""The config of `postrain up`: the kernel's RunConfig plus the head's own sections.

    [balancer]                     # optional; see BalancerSection
    max_workers = 4

    [tracking]                     # optional; see cli/tracking.py
    backends = ["mlflow"]

The schema and its loaders live in postrain.actors.configs.run_config, below both this
layer and the bench, which reads run configs too; they are this package's
names as well.
"""
from postrain.actors.configs.run_config import (  # noqa: F401 - re-exported: the head's config
    BalancerSection, TrackingSection, UpConfig, load_up_config, parse_up_config,
)
