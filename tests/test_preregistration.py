"""A calibration record proves its age and its claims (``preregistration.age_problems``, ``claims.changed_claims``):
each forgery below is refused with one line naming the record's file."""

from __future__ import annotations

import calendar
import dataclasses
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from softprior import claims as C
from softprior import preregistration as R

REG = R.REGISTERED
T0 = calendar.timegm((2026, 1, 10, 12, 0, 0))  # the fake repository's first commit


def _stamp(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _record(registered_at: float, scheme: int | None = 2, **over) -> dict:
    rec = {"task": "assoc_recall", "keys": ["k"], "task_options": {"n_pairs": 4}, "model_options": {},
           "registered_at": _stamp(registered_at), **over}
    if scheme is not None:
        rec["hash_scheme"] = scheme
    rec["hash"] = R.record_hash(rec)
    return rec


def _git(repo: Path, *args: str, when: float | None = None) -> None:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    if when is not None:
        env["GIT_COMMITTER_DATE"] = env["GIT_AUTHOR_DATE"] = f"@{int(when)} +0000"
    subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True)


def _ship(repo: Path, rec: dict, when: float | None) -> str:
    """Write ``rec`` as the repository's shipped assoc_recall record; commit it at ``when`` (None: not at all)."""
    rel = f"{REG}/assoc_recall.json"
    (repo / rel).parent.mkdir(parents=True, exist_ok=True)
    (repo / rel).write_text(json.dumps(rec))
    if when is not None:
        _git(repo, "add", rel)
        _git(repo, "commit", "-m", "register", when=when)
    return rel


@pytest.fixture
def repo(tmp_path):
    r = tmp_path / "repo"
    r.mkdir()
    _git(r, "init", "-q")
    return r


def _problems(repo: Path, rec: dict, rel: str, first_row: float | None) -> list[tuple[str, str]]:
    return R.age_problems({rec["hash"]: first_row}, [(rel, rec)], repo=repo)


def test_a_record_committed_between_its_registration_and_its_first_row_proves_its_age(repo):
    rec = _record(T0 - 60)
    rel = _ship(repo, rec, T0)
    assert R.first_commits(repo)[rel][1] == T0
    assert _problems(repo, rec, rel, T0 + 3600) == [] and _problems(repo, rec, rel, None) == []


def test_a_forged_and_rehashed_record_is_refused(repo):
    """Its options changed and its hash recomputed: it verifies, but no commit ships it as it is now."""
    rel = _ship(repo, _record(T0 - 60), T0)
    forged = _record(T0 - 60, task_options={"n_pairs": 8})
    R.verify_record(forged, rel)  # the hash is its content's
    _ship(repo, forged, None)
    ((where, why),) = _problems(repo, forged, rel, None)
    assert where == rel and "no commit ships it with its present content" in why and "\n" not in why


def test_a_rewritten_record_committed_later_with_its_old_time_is_refused(repo):
    """Write-once (issue: a shipped record's options changed, re-hashed, its ``registered_at`` kept, and
    the change committed): its present content was first committed long after its registration."""
    rel = _ship(repo, _record(T0 - 60), T0)
    forged = _record(T0 - 60, model_options={"embed_init_std": 0.5})
    _ship(repo, forged, T0 + 86400)
    ((where, why),) = _problems(repo, forged, rel, None)
    assert where == rel and "never rewritten" in why and "\n" not in why
    # committed within the window of its registration: accepted
    fresh = _record(T0 + 86400 - 60 * (R.WRITE_ONCE_MINUTES - 1), model_options={"embed_init_std": 0.7})
    _ship(repo, fresh, T0 + 86400 + 60)
    assert _problems(repo, fresh, rel, None) == []


def test_a_back_dated_record_is_refused(repo):
    """Registered (by its own word) before the first row, but first committed after that row had started."""
    rec = _record(T0 - 7200)
    rel = _ship(repo, rec, T0)
    ((where, why),) = _problems(repo, rec, rel, T0 - 3600)
    assert where == rel and "after the first prediction row it covers started" in why and "back-dated" in why
    # its time moved past its first commit (v2: re-hashed with it) is refused too
    late = _record(T0 + 600)
    rel = _ship(repo, late, T0 + 60)
    ((_, why),) = _problems(repo, late, rel, None)
    assert "before its registered_at" in why


def test_a_record_registered_after_its_first_row_is_refused_outside_git():
    rec = _record(T0)
    ((where, why),) = R.age_problems({rec["hash"]: T0 - 1}, [("bundle/records/x.json", rec)], repo=None)
    assert where == "bundle/records/x.json" and "registered after the fact" in why


def test_a_version_1_record_with_a_wrong_hash_is_refused():
    """v1 hashes leave ``registered_at`` out, not the content: an edited v1 record is refused."""
    v1 = _record(T0, scheme=None)
    assert "hash_scheme" not in v1 and R.verify_record(v1, "legacy.json") is v1
    with pytest.raises(R.RecordRefused) as e:
        R.verify_record({**v1, "task_options": {"n_pairs": 9}}, "legacy.json")
    assert "legacy.json" in str(e.value) and "scheme v1" in str(e.value) and "\n" not in str(e.value)
    # and its time, which v1 does not hash, is held by git: a v1 record edited since its commit is refused
    shipped = json.loads((Path(R.__file__).parent / "calibration" / "registered" / "legacy-markov.json").read_text())
    assert "hash_scheme" not in shipped
    R.verify_record(shipped, "legacy-markov.json")


def test_a_shipped_v1_record_whose_time_was_edited_is_refused_in_git(repo):
    rec = _record(T0 - 60, scheme=None)
    rel = _ship(repo, rec, T0)
    edited = {**rec, "registered_at": _stamp(T0 - 86400)}  # the same hash (v1 leaves the time out)
    assert R.record_hash(edited) == rec["hash"]
    _ship(repo, edited, None)
    ((_, why),) = _problems(repo, edited, rel, None)
    assert "no commit ships it with its present content" in why


def test_the_shipped_records_prove_their_age_in_this_checkout():
    """The package's records, against the committed bundle's first rows (``docs/results/bundle``)."""
    repo = R.package_repo()
    if repo is None:
        pytest.skip("not a full git checkout")
    manifest = json.loads((repo / "docs/results/bundle/manifest.json").read_text())
    first = {h: v["first_row"] for h, v in manifest["records"].items()}
    assert len(first) == 5  # the three task-family records, the identified set and the blocked regime's map
    assert R.age_problems(first) == []


def test_a_changed_claim_is_named_and_its_verdict_refused(monkeypatch):
    """A threshold moved after registration: the verdict table refuses that claim's verdict and says
    which predicate changed; the other claims keep theirs."""
    from softprior.paper import load_tables, verdict_table
    results = Path(R.__file__).resolve().parents[2] / "docs" / "results"
    i = next(i for i, c in enumerate(C.CLAIMS) if c.name == "fade keeps (base)")
    cl = C.CLAIMS[i]
    moved = dataclasses.replace(cl.conditions[0], value=cl.conditions[0].value - 0.2)
    registered = C.claims_spec()
    before = verdict_table(load_tables(results), results)
    claims = list(C.CLAIMS)
    claims[i] = dataclasses.replace(cl, conditions=[moved, *cl.conditions[1:]])
    monkeypatch.setattr(C, "CLAIMS", claims)  # (paper.py reads claims.CLAIMS through claims.verdicts)
    monkeypatch.setattr("softprior.paper.CLAIMS", claims)
    changes = C.changed_claims(registered)
    assert list(changes) == ["fade keeps (base)"] and "condition 1 registered as" in changes["fade keeps (base)"][0]
    table = verdict_table(load_tables(results), results)
    (row,) = [line for line in table.splitlines() if line.startswith(f"| {cl.statement} |")]
    assert C.REFUSED in row and cl.conditions[0].describe() in row and moved.describe() in row
    assert sum(C.REFUSED in line for line in table.splitlines()) == 1 + sum(C.REFUSED in line for line in before.splitlines())


# ------------------------------------------------------------------ at train, verify and report time
def _packaged(monkeypatch, repo: Path, rec: dict, committed_at: float | None) -> None:
    """Make ``repo``'s registered directory the package's shipped records, holding ``rec``."""
    rel = _ship(repo, rec, committed_at)
    monkeypatch.setattr(R, "_shipped_files", lambda: [repo / rel])
    monkeypatch.setattr(R, "package_repo", lambda: repo)
    R._VERIFIED.clear()


def _row():
    from conftest import tiny_config
    return tiny_config(path="fade10", steps=4, eval_every=2, task_options={"n_pairs": 4})  # a prediction row


def test_training_under_a_forged_shipped_record_is_refused(monkeypatch, repo, tmp_path):
    from softprior.executors.sweep import execute
    from softprior.store import RunStore
    row = _row()
    honest = _record(time.time() - 600, keys=[R.calibration_key(row)])
    _packaged(monkeypatch, repo, honest, time.time() - 300)
    store = RunStore(tmp_path / "s")
    assert execute([row], store, progress=False).trained == 1  # committed before the row: it trains
    forged = _record(time.time() - 600, keys=[R.calibration_key(_row().model_copy(update={"seed": 1}))],
                     task_options={"n_pairs": 4, "rewritten": True})
    _packaged(monkeypatch, repo, forged, None)  # rewritten and rehashed, not committed
    with pytest.raises(R.RecordRefused) as e:
        execute([_row().model_copy(update={"seed": 1})], RunStore(tmp_path / "t"), progress=False)
    assert "no commit ships it with its present content" in str(e.value) and "\n" not in str(e.value)


def _rewritten(monkeypatch, repo: Path) -> dict:
    """The issue's forgery in ``repo``: an honest record for ``_row()`` committed at registration, then
    its options changed, re-hashed with its old ``registered_at`` kept, and committed (a minute ago)."""
    now = time.time()
    honest = _record(now - 7200, keys=[R.calibration_key(_row())])
    _packaged(monkeypatch, repo, honest, now - 7100)
    forged = _record(now - 7200, keys=[R.calibration_key(_row())], model_options={"embed_init_std": 0.5})
    _packaged(monkeypatch, repo, forged, now - 60)
    return forged


def test_a_rewritten_committed_record_is_refused_by_train_and_by_store_verify(monkeypatch, repo, tmp_path):
    from softprior.executors.sweep import execute
    from softprior.store import RunStore
    from softprior.store.integrity import verify_store
    _rewritten(monkeypatch, repo)
    with pytest.raises(R.RecordRefused) as e:
        execute([_row()], RunStore(tmp_path / "s"), progress=False)
    assert "never rewritten" in str(e.value) and "\n" not in str(e.value)
    rep = verify_store(tmp_path / "s")
    assert not rep.healthy and any("never rewritten" in p.what for p in rep.problems)


def test_store_verify_reports_a_forged_shipped_record_and_a_changed_claim(monkeypatch, repo, tmp_path):
    from softprior.store import RunStore
    from softprior.store.integrity import verify_store
    RunStore(tmp_path / "s")
    spec = C.claims_spec()
    moved = [{**spec[0], "conditions": ["something else", *spec[0]["conditions"][1:]]}, *spec[1:]]
    rec = _record(T0 - 60, claims=moved)
    _packaged(monkeypatch, repo, rec, None)
    rep = verify_store(tmp_path / "s")
    assert not rep.healthy
    assert [p.file for p in rep.problems] == [f"{REG}/assoc_recall.json"]
    assert "no commit ships it" in rep.problems[0].what
    (changed,) = rep.shipped_claims_changed  # the package's own record: reported, the store not blamed for it
    assert changed.startswith(f"{REG}/assoc_recall.json: {spec[0]['name']}: condition 1 registered as 'something else'")
    lines = rep.lines()
    assert any(line.startswith("note: the package's declaration changed") and spec[0]["name"] in line
               and "refused" in line for line in lines)


def test_a_bundle_checks_its_records_against_its_manifest(tmp_path, monkeypatch):
    """Outside git: a record the manifest does not list (swapped in after the bundle was written) and
    a record registered after its first row (by the manifest's clock) are refused, one line each."""
    import shutil

    from softprior.bundle import BundleSource
    from softprior.store.record_clock import verify_named
    monkeypatch.setattr(R, "package_repo", lambda: None)
    src = Path(R.__file__).resolve().parents[2] / "docs" / "results" / "bundle"
    b = tmp_path / "bundle"
    shutil.copytree(src, b)
    manifest = json.loads((b / "manifest.json").read_text())
    h = sorted(manifest["records"])[0]
    assert verify_named(BundleSource(b), [h])  # as committed: accepted
    rec = json.loads((b / "records" / f"{h}.json").read_text())
    early = dict(manifest, records={**manifest["records"], h: {"first_row": R.registered_time(rec) - 1}})
    (b / "manifest.json").write_text(json.dumps(early))
    with pytest.raises(R.RecordRefused) as e:
        verify_named(BundleSource(b), [h])
    assert "registered after the fact" in str(e.value) and "\n" not in str(e.value)
    del early["records"][h]
    (b / "manifest.json").write_text(json.dumps(early))
    with pytest.raises(R.RecordRefused) as e:
        verify_named(BundleSource(b), [h])
    assert "the bundle's manifest does not list this record" in str(e.value)


def test_a_confidence_changed_after_registration_is_named_and_refused(monkeypatch):
    """The confidence level is a predicate field like any other: moved after registration, every claim
    registered under the old level reads as changed (and its verdict is refused)."""
    registered = C.claims_spec()
    monkeypatch.setattr(C, "CONFIDENCE", 0.9)
    changes = C.changed_claims(registered)
    assert set(changes) == {c.name for c in C.CLAIMS}
    assert all(lines == ["confidence registered as 0.95, declared now as 0.9"] for lines in changes.values())
    refused = [v for _, v, _ in C.verdicts({}, changed=changes)]
    assert refused == [C.REFUSED] * len(C.CLAIMS)
