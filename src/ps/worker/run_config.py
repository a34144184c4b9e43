"""What a worker takes from its registration: the run's config as the server sent it, with the worker's own fields,
and the check that it was given an address for every shard the server runs.

The worker learns the run from the server (the training and compression settings, the model), so a worker on
another host needs only the server's address and the auth token; its own config keeps only what is local to its
machine (:data:`LOCAL_FIELDS`).
"""

from __future__ import annotations

import json

from src.config import Config, SetupError, validate_config
from src.ps.server.members import SERVER_PATHS

LOCAL_FIELDS = (
    *SERVER_PATHS,  # its own files and folders (the server does not send its own)
    "training.device",
    "system.server_address",
    "system.shard_addresses",
    "system.transport",
    "system.inject_faults",
    "system.max_rejoins",
)
"""Fields a worker takes from its own config; everything else comes from the server."""


def merge_run_config(local: Config, run_config_json: str) -> Config:
    """The server's run config with this worker's :data:`LOCAL_FIELDS` put back."""
    merged = json.loads(run_config_json)
    mine = local.to_dict()
    for dotted in LOCAL_FIELDS:
        section, field = dotted.split(".")
        merged[section][field] = mine[section][field]
    return validate_config(merged)


def check_shard_addresses(shards: int, given: int, how: str) -> None:
    """A server split across ``shards`` shards (its registration's ``system.num_servers``) needs a connection to every
    shard: ``given`` addresses were (``how``: where a worker gives them, for the message).

    Raises:
        SetupError: another number of addresses.
    """
    if given != shards:
        raise SetupError(
            f"the server runs {shards} shard{'s' if shards > 1 else ''}: {how} every shard's host:port, shard 0 first "
            f"(got {given} address{'' if given == 1 else 'es'})"
        )


__all__ = ["LOCAL_FIELDS", "check_shard_addresses", "merge_run_config"]
