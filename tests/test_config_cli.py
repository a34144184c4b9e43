"""Config from the command line: ``--set dotted.field=value`` on every runner, ``--print-config``, ``--tracker``.

The runners' ``main`` run in this process: they exit at ``--print-config`` or at a bad config,
before any training, so these tests take milliseconds.
"""

from __future__ import annotations

import importlib.util

import pytest
import yaml

from tests.ps_fixtures import ROOT

SECRET = "do-not-print-me-7f3a"


def _runner(path: str):
    spec = importlib.util.spec_from_file_location(path.replace("/", "_").removesuffix(".py"), ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


RUNNERS = {
    "baseline": "run_baseline_training.py",
    "parameter_server": "run_parameter_server_training.py",
    "ddp": "run_ddp_training.py",
    "experiment": "scripts/run_experiment.py",
}


def exit_of(main, argv: list[str], capsys) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of a runner that exits before training."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        status = main(argv)
        raise SystemExit(status)  # run_experiment returns its status instead of raising
    out, err = capsys.readouterr()
    return exited.value.code, out, err


def _argv(name: str, *args: str) -> list[str]:
    return (["--config", str(ROOT / "configs" / "experiments" / "smoke.yaml")] if name == "experiment" else []) + list(
        args
    )


@pytest.mark.parametrize("name", RUNNERS)
def test_set_reaches_nested_fields_and_print_config_shows_the_resolved_config(name, capsys):
    code, out, err = exit_of(
        _runner(RUNNERS[name]),
        _argv(
            name,
            *(
                "--set training.weight_decay=1e-4 --set emulation.workers.1.slowdown=4 --set "
                "training.max_train_samples=null --set "
                "system.inject_faults=[kill:worker=1@step=40] --set"
            ).split(),
            f"system.auth_token={SECRET}",
            "--tracker",
            "mlflow",
            "--log-level",
            "WARNING",
            "--print-config",
        ),
        capsys,
    )
    assert (code, err) == (0, "")
    printed = yaml.safe_load(out)
    assert printed["training"]["weight_decay"] == pytest.approx(1e-4)  # YAML's 1e-4 is a string; the schema reads it
    assert list(printed["emulation"]["workers"]) == ["1"] and printed["emulation"]["workers"]["1"]["slowdown"] == 4.0
    assert printed["training"]["max_train_samples"] is None
    assert printed["system"]["inject_faults"] == ["kill:worker=1@step=40"]
    assert printed["system"]["log_level"] == "warning"
    assert printed["metrics"]["trackers"] == ["tensorboard", "mlflow"]  # --tracker adds to the list
    assert SECRET not in out and "auth_token" not in printed["system"]  # a secret is never dumped


@pytest.mark.parametrize("name", RUNNERS)
def test_a_bad_path_is_one_line_naming_it_and_exit_2(name, capsys):
    code, out, err = exit_of(_runner(RUNNERS[name]), _argv(name, "--set", "training.weight_decai=0.1"), capsys)
    assert code == 2 and out == ""
    assert err.splitlines() == ["config error: training.weight_decai: unknown key"]


@pytest.mark.parametrize(
    ("assignment", "line"),
    [
        (
            "emulation.workers.1.slowdown=0.5",
            "config error: emulation.workers.1.slowdown: must be >= 1 (1 = the machine's own speed), got 0.5",
        ),
        ("training.batch_size=many", "config error: training.batch_size: must be an integer, got 'many'"),
        (
            "metrics.trackers=[mlflow, mlflow]",
            "config error: metrics.trackers: lists mlflow more than once, got ['mlflow', 'mlflow']",
        ),
        (
            f"system.auth_token=[{SECRET}]",
            "config error: system.auth_token: must be a string (value not shown: it is a secret)",
        ),
    ],
)
def test_a_bad_value_is_one_line_naming_the_field_and_exit_2(assignment, line, capsys):
    code, out, err = exit_of(_runner(RUNNERS["baseline"]), ["--set", assignment], capsys)
    assert (code, out, err.splitlines()) == (2, "", [line])


@pytest.mark.parametrize(
    ("argument", "problem"),
    [
        ("training.batch_size", "expected dotted.field=value"),
        ("batch_size=3", "'batch_size' must be a dotted field name"),
        ("training..batch_size=3", "must be a dotted field name"),
        ("training.batch_size=[1, 2", "training.batch_size: value '[1, 2' is not valid YAML"),
    ],
)
def test_a_malformed_set_is_a_usage_error(argument, problem, capsys):
    code, out, err = exit_of(_runner(RUNNERS["ddp"]), ["--set", argument], capsys)
    assert code == 2 and out == ""
    assert ": error: argument --set: " in err.splitlines()[-1] and problem in err.splitlines()[-1]


def test_set_overrides_flags_and_a_field_the_runner_fixes_is_refused(capsys):
    main = _runner(RUNNERS["parameter_server"])
    code, out, _ = exit_of(main, ["--batch-size", "8", "--set", "training.batch_size=16", "--print-config"], capsys)
    assert code == 0 and yaml.safe_load(out)["training"]["batch_size"] == 16
    code, out, err = exit_of(main, ["--set", "system.architecture=ddp"], capsys)
    assert (code, err.splitlines()) == (
        2,
        ["config error: system.architecture: fixed by this runner to 'parameter_server', cannot be --set"],
    )


def test_print_config_reads_back_as_the_same_config(tmp_path, capsys):
    from src.config import load_config

    code, out, _ = exit_of(
        _runner(RUNNERS["baseline"]),
        ["--set", "emulation.workers.2.step_delay_s=0.5", "--trace", "--print-config"],
        capsys,
    )
    assert code == 0
    (tmp_path / "resolved.yaml").write_text(out)
    again = load_config(tmp_path / "resolved.yaml")
    assert again.emulation.workers[2].step_delay_s == 0.5 and again.system.trace is True
    assert again.to_dict() == yaml.safe_load(out)


@pytest.fixture
def fresh_logging():
    """Logging as an unconfigured process has it, and back as it was afterwards."""
    import logging

    from src.telemetry import logs

    saved = (
        logs._handler,
        logging.getLogger().level,
        {name: logging.getLogger(name).level for name in logs.PROJECT_LOGGERS},
    )
    if logs._handler is not None:
        logging.getLogger().removeHandler(logs._handler)
    logs._handler = None
    yield
    if logs._handler is not None:
        logging.getLogger().removeHandler(logs._handler)
    logs._handler = saved[0]
    if saved[0] is not None:
        logging.getLogger().addHandler(saved[0])
    logging.getLogger().setLevel(saved[1])
    for name, level in saved[2].items():
        logging.getLogger(name).setLevel(level)


def test_setup_logging_sets_our_level_and_keeps_libraries_at_warning(fresh_logging, capsys):
    import logging

    from src.telemetry.logs import setup_logging

    setup_logging("warning")
    logging.getLogger("src.trainer").info("hidden")
    logging.getLogger("src.trainer").warning("shown %d", 1)
    logging.getLogger("some.library").info("library info")
    setup_logging("debug")  # a second call changes the level only: no second handler
    logging.getLogger("src.launch.ps").debug("debug line")
    logging.getLogger("some.library").info("library info again")
    err = capsys.readouterr().err.splitlines()
    assert [line.split(" ", 1)[1] for line in err] == [
        "WARNING src.trainer: shown 1",
        "DEBUG src.launch.ps: debug line",
    ]
    with pytest.raises(ValueError, match="system.log_level"):
        setup_logging("loud")


def test_every_runner_has_the_flags_in_its_help(capsys):
    for name, path in RUNNERS.items():
        code, out, _ = exit_of(_runner(path), ["--help"], capsys)
        assert code == 0
        for flag in ("--set FIELD=VALUE", "--print-config", "--log-level", "--trace", "--tracker NAME"):
            assert flag in out, (name, flag)


def test_transport_flag_sets_the_field_and_refuses_an_unknown_one(capsys):
    main = _runner(RUNNERS["parameter_server"])
    code, out, _ = exit_of(main, ["--transport", "tcp", "--print-config"], capsys)
    assert code == 0 and yaml.safe_load(out)["system"]["transport"] == "tcp"
    code, _, err = exit_of(main, ["--transport", "udp"], capsys)
    assert code == 2 and "argument --transport: invalid choice: 'udp' (choose from 'grpc', 'tcp')" in err
    code, _, err = exit_of(main, ["--set", "system.transport=udp"], capsys)
    assert code == 2 and "system.transport" in err
