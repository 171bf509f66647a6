"""The compile job's config for the tests: ``job``'s base config compiled by ``job = compile``,
with ``section__field=value`` overrides (``compile__topology="v5e-4"``)."""

from __future__ import annotations

from meshrl.configs import Config, base_config, from_config_dict


def compile_config(job: str, **fields: object) -> Config:
    cfg = base_config(job)
    cfg.job = "compile"
    for key, value in fields.items():
        section, name = key.split("__")
        cfg[section][name] = value
    return from_config_dict(cfg)
