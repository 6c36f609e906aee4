"""What the docs say about timings, defaults and wiring, held to the code (issue #40: four of ten claims
checked had drifted). Each row is a phrase a page must contain, written from the constant it quotes: change
the constant and the page must change with it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import click
import pytest

from gpushared.cli import extender as extender_cli
from gpushared.contract import dra
from gpushared.core.placement import mixbook, policies, reservations
from gpushared.core.shared.verdicts import MAX_MPS_CLIENTS
from gpushared.daemon import candidates, endpoints, service
from gpushared.daemon.config import OPTIONS
from gpushared.extender import app, evictioncap, inbox, nominations, priming, state, tasks
from gpushared.kube import informer

DOCS = Path(__file__).resolve().parents[2] / "docs"
ROOT = DOCS.parent


def cli_default(name: str) -> Any:
    command: click.Command = extender_cli.main
    return next(param.default for param in command.params if param.name == name)


def seconds(value: float) -> str:
    return f"{value:g} s"


def words(n: int) -> str:
    return {2: "two", 3: "three", 4: "four", 5: "five"}[n]


def config_key(field: str) -> str:
    return next(option.key for option in OPTIONS if option.field == field)


LEASE = cli_default("lease_seconds")
CLAIMS = [
    # the DRA driver (docs/dra.md)
    ("dra.md", f"past the {MAX_MPS_CLIENTS} clients an MPS server takes"),
    ("dra.md", f"driverName: {dra.DRIVER}   # the default"),
    ("dra.md", f"cdiRoot: {next(o.default() for o in OPTIONS if o.field == 'cdi_root')}          # where"),
    ("dra.md", f"`{dra.CDI_KIND}=<claim UID>-<request>`"),
    ("dra.md", f"apiVersion: {dra.CONFIG_API_VERSION}\n  kind: {dra.CONFIG_KIND}"),
    # preemption
    ("design.md", f"at most `HOLD_SECONDS` ({nominations.HOLD_SECONDS:g} s)"),
    ("design.md", f"`--max-evictions-per-minute` pods ({evictioncap.MAX_EVICTIONS_PER_MINUTE})"),
    ("install.md", f"`--max-evictions-per-minute` ({evictioncap.MAX_EVICTIONS_PER_MINUTE})"),
    # the extender's loop and its watchdog
    ("design.md", f"for {seconds(tasks.LOOP_ALIVE_SECONDS)} (`LOOP_ALIVE_SECONDS`)"),
    ("design.md", f"for {seconds(app.WEDGED_SECONDS)} (`WEDGED_SECONDS`)"),
    ("design.md", f"up to {inbox.BATCH:,} a\nturn"),
    # the cache and its watches
    ("design.md", f"`--watch-seconds` ({cli_default('watch_seconds')})"),
    ("design.md", f"{seconds(informer.SILENCE_GRACE)} past\nthat is dead"),
    ("design.md", f"takes a new mix every {seconds(state.MIX_SECONDS)}"),
    ("design.md", f"not confirmed after {seconds(reservations.CONFIRM_SECONDS)} is read back"),
    ("design.md", f"`--binding-landing-seconds` ({cli_default('binding_landing_seconds'):g}) after the write"),
    ("design.md", f"`--binding-landing-seconds` ({reservations.LANDING_SECONDS:g}) it binds nothing"),
    ("design.md", f"(`?timeout={reservations.BINDING_TIMEOUT_SECONDS:g}s`,"),
    ("design.md", f"({reservations.FENCE_SECONDS:g} s,\n  `FENCE_SECONDS`)"),
    # the placement constants tuned by scripts/tune_placement.py (issue #41)
    ("design.md", f"`BINPACK_PRESSURE` ({policies.BINPACK_PRESSURE:g} GPUs"),
    ("design.md", f"`FGD_PRESSURE` ({policies.FGD_PRESSURE:g} levels"),
    ("install.md", f"(default {mixbook.EXPECTED_WEIGHT:,.0f})"),
    ("design.md", f"at most {mixbook.MAX_EXPECTED_KINDS:,} kinds (`MAX_EXPECTED_KINDS`"),
    # the primer
    ("design.md", f"a pod offered more than {seconds(priming.STALE_SECONDS)} ago is passed over"),
    ("design.md", "takes at most a quarter of the\nevent loop's time" if priming.SHARE == 0.25 else "(SHARE changed)"),
    # leader election: what app.py derives from --lease-seconds
    (
        "design.md",
        f"every {seconds(LEASE / 7.5)}, and stops serving if it cannot renew within {seconds(LEASE * 2 / 3)}",
    ),
    ("design.md", f"before the Lease ({seconds(LEASE)}) can pass"),
    # the daemon
    (
        "design.md",
        f"tried {words(candidates.ATTEMPTS)} times, {seconds(candidates.RETRY_SECONDS)} apart "
        "(`candidates.ATTEMPTS`, `RETRY_SECONDS`)",
    ),
    (
        "design.md",
        f"{endpoints.MAX_CONNECTIONS} connections per listener, each closed after "
        f"{seconds(endpoints.IDLE_SECONDS)} idle or {seconds(endpoints.REQUEST_SECONDS)} in all",
    ),
    (
        "daemon.md",
        "`SIGHUP` re-reads the file: "
        + ", ".join(f"`{config_key(field)}`" for field in ["log_level", "ignored_xids"])
        + f" and `{config_key('recover_after')}` apply at\nonce",
    ),
]


@pytest.mark.parametrize(("page", "phrase"), CLAIMS)
def test_the_docs_quote_the_code(page: str, phrase: str) -> None:
    text = (DOCS / page).read_text()
    flat = re.sub(r"\s+", " ", text)
    assert re.sub(r"\s+", " ", phrase) in flat, f"docs/{page} no longer says: {phrase!r}"


def test_the_live_options_are_the_ones_the_daemon_reloads() -> None:
    assert {"log_level", "ignored_xids", "recover_after"} == service.LIVE_OPTIONS


def test_one_default_for_ranking_in_filter() -> None:
    """The CLI's default is the settings' default; the scheduler has none of its own."""
    assert cli_default("rank_in_filter") is app.ExtenderSettings.__dataclass_fields__["rank_in_filter"].default


def test_every_module_the_docs_name_exists() -> None:
    """A path under gpushared/ that a page names in backquotes is there (moved modules leave no ghosts)."""
    missing = []
    for page in [*DOCS.glob("*.md"), ROOT / "README.md"]:
        for path in re.findall(
            r"`((?:gpushared/)?(?:extender|daemon|core|kube|contract|replay|cli|nvml|mps)/[\w/]+\.py)`",
            page.read_text(),
        ):
            full = ROOT / (path if path.startswith("gpushared/") else f"gpushared/{path}")
            if not full.exists():
                missing.append(f"{page.name}: {path}")
    assert missing == []


def test_one_default_for_the_eviction_cap() -> None:
    """The CLI's default is the preempter's and the settings' default."""
    from gpushared.extender.evictioncap import MAX_EVICTIONS_PER_MINUTE

    assert cli_default("max_evictions_per_minute") == MAX_EVICTIONS_PER_MINUTE
    assert app.ExtenderSettings.__dataclass_fields__["max_evictions_per_minute"].default == MAX_EVICTIONS_PER_MINUTE
