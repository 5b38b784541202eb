"""pipeline-monitor over a fleet name (monitor/fleet.py, the fleet parts of render.py and cli.py),
in-process: an injected resolver and stand-in stats clients. A real dnsmasq and real servers:
tests/e2e/test_discovery.py."""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import pytest
from batchwire.monitor import cli, fleet
from batchwire.monitor.fleet import FleetPoller, FleetSnapshot, FleetWatch, ServerView
from batchwire.monitor.render import fleet_frame, render_fleet
from batchwire.wire.stats import ServerStats
from batchwire.wire.stats_client import StatsTimeout, StatsUnavailable
from monitorsnaps import SNAP

NAME = "dns+tcp://fleet.test:5555"


def snap(images_per_s: float) -> ServerStats:
    tp = dataclasses.replace(SNAP.throughput, images_per_s=images_per_s)
    return dataclasses.replace(SNAP, throughput=tp)


class FakeClient:
    """A StatsClient stand-in: answers ``answers[endpoint]`` (a ServerStats, or an exception
    to raise) after ``delay`` seconds."""

    def __init__(self, endpoint: str, answers: dict, delay: float = 0.0) -> None:
        self.endpoint, self.answers, self.delay = endpoint, answers, delay
        self.closed = False
        self.fetches = 0

    def fetch(self) -> ServerStats:
        self.fetches += 1
        if self.delay:
            time.sleep(self.delay)
        answer = self.answers[self.endpoint]
        if isinstance(answer, Exception):
            raise answer
        return answer

    def close(self) -> None:
        self.closed = True


class Records:
    """What the fake DNS says now."""

    def __init__(self, *addresses: str) -> None:
        self.addresses = list(addresses)

    def __call__(self, name: str, port: int) -> list[str]:
        assert (name, port) == ("fleet.test", 5555)
        return list(self.addresses)


def poller(records: Records, answers: dict, delay: float = 0.0, timeout: float = 5.0):
    clients: dict[str, FakeClient] = {}

    def make(ep: str) -> FakeClient:
        clients[ep] = FakeClient(ep, answers, delay)
        return clients[ep]

    return FleetPoller(NAME, timeout, resolve=records, make_client=make), clients


def test_every_server_is_asked_and_one_that_does_not_answer_is_shown_as_such() -> None:
    records = Records("127.0.0.3", "127.0.0.2", "127.0.0.4")
    answers = {
        "tcp://127.0.0.2:5555": snap(100.0),
        "tcp://127.0.0.3:5555": StatsTimeout("no answer from tcp://127.0.0.3:5555 within 5 s"),
        "tcp://127.0.0.4:5555": snap(50.0),
    }
    p, _ = poller(records, answers)
    assert p.initial() == ["tcp://127.0.0.2:5555", "tcp://127.0.0.3:5555", "tcp://127.0.0.4:5555"]
    got = p.poll(resolve=False)
    assert [s.endpoint for s in got.servers] == p.endpoints
    assert [s.stats is not None for s in got.servers] == [True, False, True]
    assert got.servers[1].error == "no answer from tcp://127.0.0.3:5555 within 5 s"
    totals = got.totals
    assert (totals.servers, totals.answering, totals.images_per_s) == (3, 2, 150.0)
    assert totals.clients == 2 * len(SNAP.clients)


def test_servers_are_asked_at_once_not_one_after_another() -> None:
    records = Records("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5")
    answers = {f"tcp://127.0.0.{i}:5555": snap(1.0) for i in (2, 3, 4, 5)}
    p, _ = poller(records, answers, delay=0.4)
    p.initial()
    started = time.monotonic()
    assert p.poll(resolve=False).totals.answering == 4
    assert time.monotonic() - started < 1.2  # 4 x 0.4 s one after another


def test_the_name_is_re_resolved_at_each_poll() -> None:
    records = Records("127.0.0.2")
    answers = {f"tcp://127.0.0.{i}:5555": snap(10.0) for i in (2, 3, 4)}
    p, clients = poller(records, answers)
    p.initial()
    assert len(p.poll().servers) == 1
    records.addresses = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]  # two servers join
    got = p.poll()
    assert [s.endpoint for s in got.servers] == [f"tcp://127.0.0.{i}:5555" for i in (2, 3, 4)]
    assert got.totals.images_per_s == 30.0 and got.dns_error is None
    records.addresses = ["127.0.0.3", "127.0.0.4"]  # one leaves: its client is closed
    assert len(p.poll().servers) == 2
    assert clients["tcp://127.0.0.2:5555"].closed
    assert clients["tcp://127.0.0.2:5555"].fetches == 2
    records.addresses = []  # a DNS hiccup: keep the servers, say so
    got = p.poll()
    assert len(got.servers) == 2 and got.totals.answering == 2
    assert got.dns_error is not None
    assert "DNS: dns+tcp://fleet.test:5555 resolves to no server now" in got.dns_error
    assert "showing the 2 servers it had" in got.dns_error
    p.close()
    assert all(c.closed for c in clients.values())


def test_a_client_that_fails_unexpectedly_spoils_only_its_own_entry() -> None:
    records = Records("127.0.0.2", "127.0.0.3")
    answers = {"tcp://127.0.0.2:5555": RuntimeError("boom"), "tcp://127.0.0.3:5555": snap(5.0)}
    p, _ = poller(records, answers)
    p.initial()
    got = p.poll()
    assert got.servers[0].error == "RuntimeError: boom" and got.servers[1].stats is not None


def test_json_entries_carry_each_servers_stats_as_sent() -> None:
    records = Records("127.0.0.2", "127.0.0.3")
    answers = {
        "tcp://127.0.0.2:5555": snap(7.0),
        "tcp://127.0.0.3:5555": StatsUnavailable("tcp://127.0.0.3:5555 refused: keys"),
    }
    p, _ = poller(records, answers)
    p.initial()
    doc = json.loads(json.dumps(p.poll().to_map()))
    assert doc["fleet"] == NAME and doc["dns_error"] is None
    first, second = doc["servers"]
    assert first["endpoint"] == "tcp://127.0.0.2:5555" and first["error"] is None
    assert ServerStats.from_map(first["stats"]) == snap(7.0)
    assert second == {
        "endpoint": "tcp://127.0.0.3:5555",
        "stats": None,
        "error": "tcp://127.0.0.3:5555 refused: keys",
    }
    assert doc["total"]["servers"] == 2 and doc["total"]["answering"] == 1
    assert doc["total"]["images_per_s"] == 7.0


def test_the_live_view_keeps_a_servers_last_answer_under_its_error() -> None:
    now = [100.0]
    watch = FleetWatch(3, clock=lambda: now[0])
    ep = "tcp://127.0.0.2:5555"
    shown = watch.update(FleetSnapshot(NAME, [ServerView(ep, snap(9.0))]))
    assert shown.servers[0].bottleneck is not None and shown.totals.answering == 1
    now[0] = 107.0
    shown = watch.update(FleetSnapshot(NAME, [ServerView(ep, None, "no answer")]))
    (view,) = shown.servers
    assert view.stats == snap(9.0) and view.error == "no answer; last answer 7 s ago"
    assert shown.totals.answering == 0 and shown.totals.images_per_s == 0.0  # not counted stale
    watch.update(FleetSnapshot(NAME, []))  # the server left the name: forgotten
    shown = watch.update(FleetSnapshot(NAME, [ServerView(ep, None, "no answer")]))
    assert shown.servers[0].stats is None


def test_the_view_stacks_every_server_under_the_fleet_totals() -> None:
    fleet_now = FleetSnapshot(
        NAME,
        [
            ServerView("tcp://127.0.0.2:5555", snap(100.0)),
            ServerView("tcp://127.0.0.3:5555", None, "no answer from tcp://127.0.0.3:5555"),
            ServerView("tcp://127.0.0.4:5555", snap(25.5)),
        ],
    )
    text = render_fleet(fleet_now, 120, waiting=False)
    lines = text.splitlines()
    assert NAME in lines[0] and "3 servers, 2 answering" in lines[0]
    assert lines[1].startswith("fleet total 125.5 img/s") and f"{2 * 2} clients" in lines[1]
    heads = [i for i, line in enumerate(lines) if line.startswith("server  tcp://")]
    assert [lines[i].split()[1] for i in heads] == [s.endpoint for s in fleet_now.servers]
    middle = lines[heads[1] : heads[2]]
    assert any("! no answer from tcp://127.0.0.3:5555" in line for line in middle)
    assert not any("waiting for the first answer" in line for line in middle)
    assert text.count("bottleneck:") == 2 and text.count("62772d7430") == 2
    for width in (40, 80):
        assert all(len(line) <= width for line in render_fleet(fleet_now, width).splitlines())


def test_a_dns_hiccup_shows_above_the_servers() -> None:
    hiccup = FleetSnapshot(NAME, [ServerView("tcp://127.0.0.2:5555", snap(1.0))], "DNS: gone")
    assert "! DNS: gone" in render_fleet(hiccup, 100).splitlines()[2]


def test_the_live_fleet_view_shares_the_height() -> None:
    import io

    from rich.console import Console

    servers = [ServerView(f"tcp://127.0.0.{i}:5555", snap(1.0)) for i in (2, 3)]
    out = io.StringIO()
    Console(file=out, width=100, height=200, color_system=None).print(
        fleet_frame(FleetSnapshot(NAME, servers), 100, 30)
    )
    text = out.getvalue()
    assert text.count("... and") == 2  # each server's client table cut to its share


# The command line, with the resolver and the stats clients replaced.


@pytest.fixture
def fake_fleet(monkeypatch: pytest.MonkeyPatch) -> tuple[Records, dict]:
    records = Records("127.0.0.2", "127.0.0.3")
    answers: dict = {}
    monkeypatch.setattr(fleet, "default_resolver", lambda: records)
    monkeypatch.setattr(
        fleet, "StatsClient", lambda ep, timeout, keys=None: FakeClient(ep, answers)
    )
    return records, answers


def test_once_json_prints_one_entry_per_server(fake_fleet, capsys) -> None:
    _, answers = fake_fleet
    answers.update({"tcp://127.0.0.2:5555": snap(3.0), "tcp://127.0.0.3:5555": snap(4.0)})
    assert cli.main([NAME, "--once", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [s["endpoint"] for s in doc["servers"]] == list(answers)
    assert doc["total"]["images_per_s"] == 7.0


def test_once_with_no_server_answering_exits_1(fake_fleet, capsys) -> None:
    _, answers = fake_fleet
    answers.update({ep: StatsTimeout(f"no answer from {ep}") for ep in ("tcp://127.0.0.2:5555",)})
    answers["tcp://127.0.0.3:5555"] = StatsTimeout("no answer from tcp://127.0.0.3:5555")
    assert cli.main([NAME, "--once"]) == 1
    out, err = capsys.readouterr()
    assert "no answer from tcp://127.0.0.2:5555" in out and "no answer from tcp://127.0.0.3" in out
    assert f"no server of {NAME} answered" in err


def test_a_name_without_records_exits_2_naming_dns(fake_fleet, capsys) -> None:
    records, _ = fake_fleet
    records.addresses = []
    assert cli.main([NAME, "--once"]) == 2
    err = capsys.readouterr().err
    assert f"cannot find the servers of {NAME}: DNS lookup failed" in err


@pytest.mark.parametrize("bad", ["dns+tcp://fleet.test", "dns+tcp://fleet.test:99999"])
def test_a_malformed_name_exits_2(bad: str, capsys) -> None:
    assert cli.main([bad, "--once"]) == 2
    assert "expected dns+tcp://NAME:PORT" in capsys.readouterr().err


def test_keys_go_to_every_server(fake_fleet, monkeypatch, tmp_path) -> None:
    _, answers = fake_fleet
    answers.update({"tcp://127.0.0.2:5555": snap(1.0), "tcp://127.0.0.3:5555": snap(1.0)})
    given = []
    monkeypatch.setattr(cli, "client_keys", lambda folder: f"keys of {folder}")

    def make(ep, timeout, keys=None):
        given.append((ep, keys))
        return FakeClient(ep, answers)

    monkeypatch.setattr(fleet, "StatsClient", make)
    assert cli.main([NAME, "--once", "--json", "--keys", str(tmp_path)]) == 0
    assert given == [(ep, f"keys of {tmp_path}") for ep in answers]


def test_live_json_re_resolves_each_refresh(fake_fleet, monkeypatch, capsys) -> None:
    records, answers = fake_fleet
    answers.update({f"tcp://127.0.0.{i}:5555": snap(1.0) for i in (2, 3, 4)})
    lines = []

    def stop_after_three(seconds: float) -> None:
        lines.append(capsys.readouterr().out)
        records.addresses = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]  # one joins
        if len(lines) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(cli.time, "sleep", stop_after_three)
    before = set(threading.enumerate())  # other tests of this worker may have left threads
    assert cli.main([NAME, "--json", "--interval", "0.01"]) == 0
    counts = [len(json.loads(line)["servers"]) for line in lines]
    assert counts == [2, 3, 3]
    started = [t for t in threading.enumerate() if t not in before]
    for thread in started:  # the per-server threads end with their request
        thread.join(timeout=5.0)
    assert not [t.name for t in started if t.is_alive()]
