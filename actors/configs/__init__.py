"""postrain.actors.configs: the run configs that ship with postrain (*.toml, data/) and UpConfig
(run_config.py), the run config `postrain up` reads: the kernel's RunConfig plus the roles' sections."""
