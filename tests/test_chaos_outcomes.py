"""The chaos soak's judgement of answers (scripts/chaos_outcomes.py): a failure is expected only where a fault whose
window overlaps the call explains it, and by that fault's kind; everything else is unexpected."""

import sys

from tests.support.paths import REPO

sys.path.insert(0, str(REPO / "scripts"))

from chaos_outcomes import KILL_GRACE_S, Tally, Window, classify, code_of  # noqa: E402


def test_the_code_of_an_outcome():
    assert code_of("unexpected UNAVAILABLE (expected OK)") == "UNAVAILABLE"
    assert code_of("unexpected stream CANCELLED") == "CANCELLED"
    assert code_of("unexpected HTTP 503 (expected 200)") == "HTTP 503"
    assert code_of("unexpected REST connection error") == "REST connection error"
    assert code_of("unexpected InferenceServerException: [StatusCode.NOT_FOUND]") == "InferenceServerException"
    assert code_of("unexpected INTERNAL reading v_3 from the checkpoint") == "INTERNAL"


def test_a_kill_explains_lost_connections_during_its_grace_only():
    kill = [Window("kill", 100.0, 100.0)]
    assert classify("predict_ok", "unexpected UNAVAILABLE (expected OK)", 99, 100.5, kill) == ("kill", "UNAVAILABLE")
    assert classify("rest_v1_ok", "unexpected REST connection error", 101, 102, kill)[0] == "kill"
    assert classify("v2_shared_memory", "unexpected InferenceServerException: x", 99, 103, kill)[0] == "kill"
    assert classify("predict_ok", "unexpected UNAVAILABLE", 101 + KILL_GRACE_S, 102 + KILL_GRACE_S, kill)[0] == (
        "unexpected"
    )
    assert classify("predict_ok", "unexpected UNAVAILABLE", 90, 99, kill)[0] == "unexpected"  # over before it
    assert classify("predict_ok", "unexpected INVALID_ARGUMENT (expected OK)", 99, 101, kill) == (
        "unexpected",
        "predict_ok: unexpected INVALID_ARGUMENT (expected OK)",
    )


def test_a_storage_fault_explains_internal_naming_the_variable_of_tables_read_calls_only():
    storage = [Window("storage", 10.0, detail="eio")]  # still open
    named = "unexpected INTERNAL reading v_7 from the checkpoint"
    assert classify("tables_read", named, 11, 12, storage) == ("storage", "INTERNAL (eio)")
    assert classify("tables_default", "unexpected INTERNAL reading v_0 from the checkpoint", 11, 12, storage)[0] == (
        "unexpected"
    )
    assert classify("tables_read", "unexpected INTERNAL: something else", 11, 12, storage)[0] == "unexpected"
    storage[0].end = 15.0
    assert classify("tables_read", named, 17, 18, storage)[0] == "unexpected"  # after the file came back


def test_floods_and_trickles():
    flood = [Window("flood", 5.0, 9.0)]
    assert classify("flood_infer", "unexpected RESOURCE_EXHAUSTED: memory", 5, 6, flood) == (
        "flood",
        "RESOURCE_EXHAUSTED",
    )
    assert classify("predict_ok", "unexpected RESOURCE_EXHAUSTED", 8, 10, flood)[0] == "flood"
    assert classify("rest_v2_ok", "unexpected HTTP 429 (expected 200)", 8, 9, flood) == ("flood", "HTTP 429")
    short = "unexpected stream answer 0: 'a message of 286 bytes needs about 572 bytes of memory, and ...'"
    assert classify("v2_stream", short, 8, 9, flood) == ("flood", "RESOURCE_EXHAUSTED (in a stream)")
    assert classify("predict_ok", "unexpected RESOURCE_EXHAUSTED", 12, 13, flood)[0] == "unexpected"
    assert classify("rest_trickle", "unexpected HTTP 408", 0, 2, []) == ("trickle", "HTTP 408")
    assert classify("rest_trickle", "unexpected HTTP 408 (connection left open)", 0, 2, [])[0] == "unexpected"


def test_the_tally_counts_by_kind():
    tally = Tally()
    window = tally.open("kill", 1.0)
    tally.close(window, 1.0)
    assert tally.record("predict_ok", "ok", 0, 1) == "ok"
    assert tally.record("predict_ok", "unexpected UNAVAILABLE (expected OK)", 0.5, 1.5) == "kill"
    assert tally.record("predict_ok", "unexpected NOT_FOUND (expected OK)", 2, 3) == "unexpected"
    tally.fail("the group did not serve again")
    summary = tally.summary()
    assert summary["calls"] == 3 and summary["answered_as_expected"] == 1
    assert summary["expected_errors"] == {"kill": {"UNAVAILABLE": 1}}
    assert summary["unexpected"] == 2 and summary["faults_injected"] == {"kill": 1}
