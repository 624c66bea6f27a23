"""The chaos checker on hand-made records: a healthy history passes, and each kind of fault the
chaos test hunts for is reported (no processes; fast)."""

from __future__ import annotations

from pathlib import Path

from tests.chaos import lease_log
from tests.chaos.checker import Report, check
from tests.chaos.records import (
    ApiMessage,
    Attempt,
    BotMessage,
    FaultRecord,
    Incarnation,
    LeaseEvent,
    OpenInbound,
    Records,
    Row,
    Stream,
    TgCall,
    TgMessage,
    answer_tag,
)
from tests.chaos.scenario import load, save

TAKEOVER = "⏹ interrupted: worker stopped responding; session taken over"


def records() -> Records:
    incs = {name: Incarnation(name, name.split(".")[0], pid=1, started_at=0.0, ready_at=0.0)
            for name in ("w1.1", "w2.1")}
    return Records(seed=7, ttl_s=3.0, answer_s=4.0, t0=0.0, traffic_end=50.0, collected_at=60.0, incarnations=incs,
                   faults=[], telegram=[], api=[], streams=[], calls=[], bot_messages=[], transcripts={},
                   open_inbound=[])


def message(rec: Records, session: str, n: int, at: float) -> TgMessage:
    tag = f"{session} m{n}"
    msg = TgMessage(tag, session, -100 - int(session[1:]), 100 + n, f"[{tag}] question", at, accepted_at=at,
                    attempts=[Attempt(at, "w1.1", 200, at)])
    rec.telegram.append(msg)
    rec.transcripts.setdefault(session, []).append(Row("user", msg.text, None, None))
    return msg


def stream(rec: Records, msg: TgMessage, number: int, via: str, start: float, end: float | None, *,
           whole: bool = True, record: bool = True, shown_until: float | None = None,
           after_tool: bool = False) -> BotMessage:
    """A provider stream for `msg` shown in the chat by `via`: whole (ends with END) or partial,
    its last edit just before `end` (or at `shown_until`)."""
    rec.streams.append(Stream(number, via, start, end, whole, msg.tag, resume=False, after_tool=after_tool))
    head = answer_tag(msg.tag, number)
    text = f"{head} w0 w1 w2 END" if whole else f"{head} w0 w1"
    bot = BotMessage(msg.chat_id, 1000 + number, via, start + 0.1, text, msg.message_id,
                     shown_until or (end or start + 1.0) - 0.05)
    rec.calls += [TgCall(bot.sent_at, via, "sendMessage", msg.chat_id, bot.message_id, head + " ", msg.message_id),
                  TgCall(bot.changed_at, via, "editMessageText", msg.chat_id, bot.message_id, text, None)]
    rec.bot_messages.append(bot)
    if record:
        rec.transcripts[msg.session].append(Row("assistant", text, None, None))
    return bot


def notice(rec: Records, msg: TgMessage, via: str, at: float, text: str = TAKEOVER, mid: int = 5000) -> None:
    rec.calls.append(TgCall(at, via, "sendMessage", msg.chat_id, mid, text, msg.message_id))
    rec.bot_messages.append(BotMessage(msg.chat_id, mid, via, at, text, msg.message_id, at))


def kinds(report: Report) -> dict[str, int]:
    return report.by_kind()


def test_a_healthy_history_passes() -> None:
    rec = records()
    for session, via in (("g01", "w1.1"), ("g02", "w2.1")):
        first = message(rec, session, 1, 1.0)
        stream(rec, first, 1 if via == "w1.1" else 3, via, 1.1, 4.5)
        second = message(rec, session, 2, 6.0)
        stream(rec, second, 2 if via == "w1.1" else 4, via, 6.1, 9.5)
    report = check(rec)
    assert report.ok, report.text()
    assert report.counts["answered"] == 4


def test_a_kill_taken_over_in_time_passes_and_a_late_one_is_reported() -> None:
    for takeover_at, late in ((4.5, False), (7.5, True)):
        rec = records()
        rec.incarnations["w1.1"].ended_at = 2.0
        rec.faults.append(FaultRecord("kill", "w1.1", 2.0, ended_at=12.0, replacement="w1.2"))
        msg = message(rec, "g01", 1, 1.0)
        stream(rec, msg, 1, "w1.1", 1.1, 2.0, whole=False, record=False)
        notice(rec, msg, "w2.1", takeover_at)
        rec.transcripts["g01"].append(Row("assistant", "", "system", "worker stopped responding; session taken over"))
        report = check(rec)
        assert kinds(report) == ({"slow-takeover": 1} if late else {}), report.text()
        assert report.counts["interrupted with notice"] == 1


def test_split_brain_shows_as_concurrent_streams_zombie_output_and_two_answers() -> None:
    rec = records()
    msg = message(rec, "g01", 1, 1.0)
    stream(rec, msg, 1, "w1.1", 1.1, 6.0)  # the old owner goes on...
    stream(rec, msg, 2, "w2.1", 3.0, 7.0)  # ...while another worker answers the same message
    report = check(rec)
    found = kinds(report)
    assert found.get("concurrent-streams") == 1 and found.get("answered-twice") == 1, report.text()
    assert found.get("zombie-output") == 1 and found.get("transcript-extra-assistant") == 1, report.text()
    assert "seed=7" in report.text()


def test_a_tool_run_counts_as_part_of_its_stream() -> None:
    rec = records()
    msg = message(rec, "g01", 1, 1.0)
    rec.streams.append(Stream(1, "w2.1", 1.1, 1.2, True, msg.tag, resume=False, tool_call=True))
    rec.transcripts["g01"] += [Row("assistant", "", None, None, tool_calls=True), Row("tool", "ok", None, None)]
    stream(rec, msg, 2, "w2.1", 4.0, 6.0, after_tool=True)
    assert check(rec).ok
    rec.streams.append(Stream(4, "w1.1", 2.0, 3.0, False, msg.tag, resume=False))  # during the tool
    report = check(rec)
    assert kinds(report).get("concurrent-streams") == 1, report.text()
    assert "tool run" in report.text()


def test_a_stopped_worker_that_closes_its_stream_on_waking_is_not_concurrent() -> None:
    rec = records()
    rec.incarnations["w1.1"].stopped.append((2.0, 9.0))
    rec.faults.append(FaultRecord("pause_long", "w1.1", 2.0, ended_at=9.0))
    msg = message(rec, "g01", 1, 1.0)
    stream(rec, msg, 1, "w1.1", 1.1, 9.3, whole=False, record=False, shown_until=1.9)  # closed 0.3 s after SIGCONT
    notice(rec, msg, "w2.1", 4.8)
    rec.transcripts["g01"].append(Row("assistant", "", "system", "worker stopped responding; session taken over"))
    rec.streams.append(Stream(2, "w2.1", 4.9, 8.0, True, msg.tag, resume=True))
    report = check(rec)
    assert report.ok, report.text()
    # ...but its first call after waking, if it was not already on its way, is a zombie's
    rec.calls.append(TgCall(9.2, "w1.1", "sendChatAction", msg.chat_id, None, "typing", None))
    assert kinds(check(rec)) == {"zombie-output": 1}
    rec.calls[-1].at = 9.01  # within INFLIGHT_S of SIGCONT: it was sent before the stop
    report = check(rec)
    assert report.ok and report.tolerated, report.text()


def test_a_worker_that_wakes_and_goes_on_with_its_turn_after_a_takeover_is_a_zombie() -> None:
    rec = records()
    rec.incarnations["w1.1"].stopped.append((2.0, 9.0))
    msg = message(rec, "g01", 1, 1.0)
    rec.streams.append(Stream(1, "w1.1", 1.1, 1.2, True, msg.tag, resume=False, tool_call=True))
    notice(rec, msg, "w2.1", 5.0)  # w2.1 takes the session over while w1.1 sleeps
    rec.transcripts["g01"].append(Row("assistant", "", "system", "worker stopped responding; session taken over"))
    rec.streams.append(Stream(2, "w1.1", 9.2, 9.4, False, msg.tag, resume=False, after_tool=True))
    report = check(rec)
    assert kinds(report) == {"zombie-output": 1}, report.text()
    assert "provider request" in report.text()


def test_a_frozen_half_answer_and_the_record_left_open_are_reported() -> None:
    rec = records()
    msg = message(rec, "g01", 1, 1.0)
    stream(rec, msg, 1, "w1.1", 1.1, 2.0, whole=False, record=False)
    rec.open_inbound.append(OpenInbound("telegram:group:-101", "9", "running", msg.text, None, -2))
    assert kinds(check(rec)) == {"frozen-half-answer": 1, "transcript-unanswered": 1, "open-inbound": 1}


def test_a_message_acknowledged_but_never_stored_is_reported() -> None:
    rec = records()
    msg = message(rec, "g01", 1, 1.0)
    rec.transcripts.pop("g01")
    rec.bot_messages.append(BotMessage(msg.chat_id, 7, "w1.1", 1.1, "I can't take messages right now", 101, 1.1))
    report = check(rec)
    assert kinds(report) == {"accepted-not-stored": 1}
    assert "I can't take messages" in report.text()


def test_a_message_the_user_replaced_before_anything_showed_needs_no_notice() -> None:
    rec = records()
    first = message(rec, "g01", 1, 1.0)
    rec.transcripts["g01"].append(Row("assistant", "", "user", "user sent a new message"))
    first.next_sent_at, first.early = 1.5, True
    second = message(rec, "g01", 2, 1.5)
    stream(rec, second, 1, "w1.1", 1.6, 5.0)
    report = check(rec)
    assert report.ok and report.counts["superseded"] == 1, report.text()
    # ...but its turn must still be closed in the transcript (here: cut off after its tool ran)
    rec.transcripts["g01"][1:2] = [Row("assistant", "", None, None, tool_calls=True), Row("tool", "ok", None, None)]
    assert kinds(check(rec)) == {"transcript-unanswered": 1}


def test_a_refusal_before_the_message_was_taken_is_not_output_of_its_turn() -> None:
    """Told "can't take messages" during an outage, taken at the retry, still thinking when a fault
    hits, then replaced by the user's next message before it showed anything: superseded, no stall."""
    rec = records()
    first = message(rec, "g01", 1, 1.0)
    first.accepted_at = 1.7
    first.attempts.insert(0, Attempt(1.0, "w2.1", 503, 1.0))
    rec.calls.append(TgCall(1.01, "w2.1", "sendMessage", first.chat_id, 900, "I can't take messages right now",
                            first.message_id))
    rec.transcripts["g01"].append(Row("assistant", "", "user", "user sent a new message"))
    rec.streams.append(Stream(1, "w1.1", 1.8, 3.3, False, first.tag, resume=False, after_tool=False))
    rec.faults.append(FaultRecord("pg_restart", "postgres", 2.5, ended_at=3.0))
    first.next_sent_at = 3.2
    second = message(rec, "g01", 2, 3.2)
    stream(rec, second, 2, "w1.1", 3.4, 7.0)
    report = check(rec)
    assert report.ok and report.counts["superseded"] == 1, report.text()


def test_tool_rows_belong_to_their_turn() -> None:
    rec = records()
    msg = message(rec, "g01", 1, 1.0)
    rec.transcripts["g01"] += [Row("assistant", "", None, None, tool_calls=True), Row("tool", "ok", None, None)]
    stream(rec, msg, 1, "w1.1", 3.0, 6.0)
    cut = message(rec, "g01", 2, 8.0)
    rec.transcripts["g01"] += [Row("assistant", "", None, None, tool_calls=True),
                               Row("tool", "[interrupted by user: stopped by user (/stop)]", "user",
                                   "stopped by user (/stop)")]
    notice(rec, cut, "w1.1", 9.0, "⏹ stopped")
    assert check(rec).ok
    rec.transcripts["g01"].append(Row("assistant", "late", None, None))
    assert kinds(check(rec)) == {"transcript-extra-assistant": 1}


def test_api_refusals_and_unrecorded_answers_are_reported() -> None:
    rec = records()
    api = ApiMessage("a01 m1", "a01", outcome="answered")
    api.attempts = [Attempt(1.0, "w1.1", 400, 1.1, error="I can't take messages right now (shared storage is "
                                                         "unavailable). Please try again shortly."),
                    Attempt(2.0, "w1.1", 200, 6.0, body=f"{answer_tag('a01 m1 t2', 1)} w0 END")]
    rec.api.append(api)
    rec.streams.append(Stream(1, "w1.1", 2.1, 5.9, True, "a01 m1 t2", resume=False))
    rec.transcripts["a01"] = [Row("user", "[a01 m1 t2] question", None, None)]
    assert kinds(check(rec)) == {"api-400-for-unavailable": 1, "api-answer-not-recorded": 1,
                                 "transcript-unanswered": 1}


def test_saved_records_check_the_same_after_loading(tmp_path: Path) -> None:
    rec = records()
    msg = message(rec, "g01", 1, 1.0)
    stream(rec, msg, 1, "w1.1", 1.1, 2.0, whole=False, record=False)
    rec.incarnations["w1.1"].stopped.append((1.5, 2.5))
    report = check(rec)
    save(rec, report, tmp_path)
    assert check(load(tmp_path / "chaos-7-redis.json")).text() == report.text()


def test_redis_back_empty_allows_one_more_ttl_for_the_quarantine() -> None:
    """After Redis lost its data the workers take no session for one TTL: an answer that comes
    within the bound plus that TTL is in time; the same delay after a plain Redis restart is a stall."""
    for kind, late in (("redis_wipe", False), ("redis_restart", True)):
        rec = records()
        rec.faults.append(FaultRecord(kind, "redis", 2.0, ended_at=3.0))
        msg = message(rec, "g01", 1, 1.0)
        stream(rec, msg, 1, "w1.1", 15.0, 16.0)  # first shown 15.1, whole at 15.95: 14.95 s after acceptance
        report = check(rec)
        assert kinds(report) == ({"stall": 1} if late else {}), report.text()


def test_a_message_recorded_after_one_sent_later_is_out_of_order() -> None:
    rec = records()
    first = message(rec, "g01", 1, 1.0)  # acknowledged at 1.0
    stream(rec, first, 1, "w1.1", 1.1, 4.0)
    second = message(rec, "g01", 2, 5.0)  # sent after the first was acknowledged
    stream(rec, second, 2, "w1.1", 5.1, 8.0)
    assert check(rec).ok
    rows = rec.transcripts["g01"]
    rec.transcripts["g01"] = rows[2:] + rows[:2]  # the second message's turn recorded first
    report = check(rec)
    assert kinds(report) == {"transcript-out-of-order": 1}, report.text()
    assert "[g01 m2]" in report.text() and "[g01 m1]" in report.text()


def test_send_order_binds_only_acknowledged_messages_and_counts_retries_as_one() -> None:
    rec = records()
    # a01 m1: first attempt timed out (never acknowledged), the client gave up on it
    lost = ApiMessage("a01 m1", "a01", outcome="refused",
                      attempts=[Attempt(1.0, "w1.1", None, 9.0, error="TimeoutError")])
    # a01 m2: answered at its second attempt
    done = ApiMessage("a01 m2", "a01", outcome="answered",
                      attempts=[Attempt(10.0, "w2.1", 503, 10.1, retry_after="1"),
                                Attempt(11.0, "w2.1", 200, 14.0, body=f"{answer_tag('a01 m2 t2', 2)} w0 END")])
    rec.api += [lost, done]
    rec.streams += [Stream(2, "w2.1", 11.1, 13.9, True, "a01 m2 t2", resume=False),
                    Stream(1, "w1.1", 15.0, 16.0, True, "a01 m1 t1", resume=False)]
    # the timed-out attempt was taken after all, after the next message: no promise was broken
    rec.transcripts["a01"] = [Row("user", "[a01 m2 t1] question 2", None, None),
                              Row("assistant", "", "system", "session lease lost"),
                              Row("user", "[a01 m2 t2] question 2", None, None),
                              Row("assistant", f"{answer_tag('a01 m2 t2', 2)} w0 END", None, None),
                              Row("user", "[a01 m1 t1] question 1", None, None),
                              Row("assistant", f"{answer_tag('a01 m1 t1', 1)} w0 END", None, None)]
    report = check(rec)
    assert "transcript-out-of-order" not in kinds(report), report.text()
    # ...but a third message sent after m2's 200 and recorded before m2 is out of order
    third = ApiMessage("a01 m3", "a01", outcome="answered",
                       attempts=[Attempt(20.0, "w1.1", 200, 24.0, body=f"{answer_tag('a01 m3 t1', 3)} w0 END")])
    rec.api.append(third)
    rec.streams.append(Stream(3, "w1.1", 20.1, 23.9, True, "a01 m3 t1", resume=False))
    rec.transcripts["a01"][0:0] = [Row("user", "[a01 m3 t1] question 3", None, None),
                                   Row("assistant", f"{answer_tag('a01 m3 t1', 3)} w0 END", None, None)]
    report = check(rec)
    assert kinds(report).get("transcript-out-of-order") == 1, report.text()
    assert "[a01 m3]" in report.text()


def test_an_api_answer_relayed_from_an_owner_that_died_just_after_is_tolerated() -> None:
    """With requests spread over random workers the turn runs on the session's owner and its
    answer is relayed: the owner's death just after the answer may lose its record (at-least-once)."""
    rec = records()
    api = ApiMessage("a01 m1", "a01", outcome="answered",
                     attempts=[Attempt(1.0, "w1.1", 200, 5.0, body=f"{answer_tag('a01 m1 t1', 1)} w0 END")])
    rec.api.append(api)
    rec.streams.append(Stream(1, "w2.1", 1.1, 4.9, True, "a01 m1 t1", resume=False))  # the owner ran it
    rec.transcripts["a01"] = [Row("user", "[a01 m1 t1] question", None, None),
                              Row("assistant", "", "system", "worker stopped responding; session taken over")]
    rec.faults.append(FaultRecord("kill", "w2.1", 5.2, ended_at=9.0))
    rec.incarnations["w2.1"].ended_at = 5.2
    report = check(rec)
    assert report.ok and report.tolerated, report.text()
    rec.faults[0].started_at = rec.incarnations["w2.1"].ended_at = 7.0  # long after: the record was lost
    assert kinds(check(rec)) == {"api-answer-not-recorded": 1}


def lease(rec: Records, at: float, op: str, holder: str, fence: int | None = None, ttl: float = 3.0,
          session: str = "g01") -> None:
    rec.leases.append(LeaseEvent(at, session, op, f"{holder.split('.')[0]}/{holder}", fence, ttl, holder))
    rec.leases_monitored = True


def test_a_lease_taken_while_its_holder_still_holds_it_is_an_overlap() -> None:
    rec = records()
    lease(rec, 1.0, "acquire", "w1.1", 100)
    lease(rec, 1.0, "extend", "w1.1")
    lease(rec, 2.0, "extend", "w1.1")  # renewed: held until 5.0
    lease(rec, 5.5, "acquire", "w2.1", 200)  # after it ran out: fine
    lease(rec, 5.5, "extend", "w2.1")
    lease(rec, 6.0, "release", "w2.1")
    lease(rec, 6.5, "acquire", "w1.1", 300)  # after the release: fine
    lease(rec, 6.5, "extend", "w1.1")
    assert check(rec).ok, check(rec).text()
    # Redis came back empty at 7.0; w2.1 took the lease while w1.1's last renewal (6.5) ran until 9.5
    rec.faults.append(FaultRecord("redis_wipe", "redis", 7.0, ended_at=7.5))
    lease(rec, 8.0, "acquire", "w2.1", 400)
    report = check(rec)
    assert kinds(report) == {"lease-overlap": 1}, report.text()
    assert "w1.1" in report.text() and "1.50 s before" in report.text() and "redis_wipe" in report.text()


def test_a_dead_holders_lease_may_be_taken_and_fences_must_grow() -> None:
    rec = records()
    rec.incarnations["w1.1"].ended_at = 2.0  # killed: its restart takes its leases over at once
    rec.incarnations["w1.2"] = Incarnation("w1.2", "w1", pid=2, started_at=2.5, ready_at=3.0)
    lease(rec, 1.0, "acquire", "w1.1", 100)
    lease(rec, 1.0, "extend", "w1.1")
    lease(rec, 3.0, "acquire", "w1.2", 200)
    assert check(rec).ok, check(rec).text()
    lease(rec, 9.0, "acquire", "w2.1", 150)  # long after, but a smaller fence
    assert kinds(check(rec)) == {"fence-not-growing": 1}


def test_lease_writes_are_read_from_the_monitor_log() -> None:
    wall = 1000.0  # the monitor's clock is Redis' wall clock: offset 1000 s from the records'
    text = (f"connect {wall + 0.9}\nOK\n"
            f'{wall + 1.0} [0 127.0.0.1:5000] "evalsha" "abc" "2" "sb:{{s:telegram:group:-101}}:lease" '
            f'"sb:{{s:telegram:group:-101}}:fence" "w1/x1" "w1" "3000"\n'
            f'{wall + 1.0} [0 lua] "HSET" "sb:{{s:telegram:group:-101}}:lease" "token" "w1/x1" "worker" "w1" '
            f'"fence" "1796538173871"\n'
            f'{wall + 1.0} [0 lua] "PEXPIRE" "sb:{{s:telegram:group:-101}}:lease" "3000"\n'
            f'{wall + 2.0} [0 127.0.0.1:5000] "evalsha" "def" "1" "sb:{{s:api:dm:a01}}:lease" "w1/x1" "7"\n'
            f'{wall + 2.0} [0 lua] "DEL" "sb:{{s:api:dm:a01}}:lease"\n'
            f"lost {wall + 3.0}\nconnect {wall + 3.5}\nOK\n"
            f'{wall + 4.0} [0 lua] "PEXPIRE" "sb:{{s:telegr')  # cut off mid-line
    incs = {"w1.1": Incarnation("w1.1", "w1", 1, started_at=0.0)}
    events, gaps = lease_log.parse(text, clock_offset=wall, incarnations=incs, ttl_s=3.0)
    assert [(e.at, e.session, e.op, e.fence, e.holder) for e in events] == [
        (1.0, "g01", "acquire", 1796538173871, "w1.1"), (1.0, "g01", "extend", None, "w1.1"),
        (2.0, "a01", "release", None, "w1.1")]
    assert events[1].ttl_s == 3.0 and events[2].token == "w1/x1"
    assert gaps == [(3.0, 3.5)]


def test_an_api_retry_asked_for_a_message_answered_and_recorded_is_reported() -> None:
    """A relayed turn answered whole and recorded while Redis was down: the relaying worker tells
    its client to try again, and the retry records the message twice."""
    rec = records()
    rec.faults.append(FaultRecord("redis_wipe", "redis", 4.0, ended_at=5.0))
    api = ApiMessage("a01 m1", "a01", outcome="answered", attempts=[
        Attempt(1.0, "w1.1", 503, 12.0, error="The worker running this conversation stopped; please try again",
                retry_after="5"),
        Attempt(13.0, "w1.1", 200, 17.0, body=f"{answer_tag('a01 m1 t2', 2)} w0 END")])
    rec.api.append(api)
    rec.streams += [Stream(1, "w2.1", 1.1, 4.5, True, "a01 m1 t1", resume=False),
                    Stream(2, "w2.1", 13.1, 16.9, True, "a01 m1 t2", resume=False)]
    rec.transcripts["a01"] = [Row("user", "[a01 m1 t1] question", None, None),
                              Row("assistant", f"{answer_tag('a01 m1 t1', 1)} w0 END", None, None),
                              Row("user", "[a01 m1 t2] question", None, None),
                              Row("assistant", f"{answer_tag('a01 m1 t2', 2)} w0 END", None, None)]
    report = check(rec)
    assert kinds(report) == {"api-refused-but-answered": 1}, report.text()
    assert "[a01 m1 t1] answered 503" in report.text() and "c1 by w2.1" in report.text()
    # the same 503 for a turn cut off (its owner died: taken over, not answered) is the retry it asks for
    rec.transcripts["a01"][1] = Row("assistant", "", "system", "worker stopped responding; session taken over")
    assert check(rec).ok, check(rec).text()
    # ...and an owner that dies just after recording its answer cannot relay it any more: tolerated
    rec.transcripts["a01"][1] = Row("assistant", f"{answer_tag('a01 m1 t1', 1)} w0 END", None, None)
    rec.faults[0] = FaultRecord("kill", "w2.1", 4.7, ended_at=8.0, replacement="w2.2")
    report = check(rec)
    assert report.ok and report.tolerated, report.text()


def test_a_turn_and_its_resume_each_taken_over_once_is_not_a_double_takeover() -> None:
    """Both takeover notices quote the user's message (a resume's id is the gateway's own): one
    ends the turn, the other its resume. Two workers ending one turn is still reported."""
    for resumed, double in ((True, False), (False, True)):
        rec = records()
        rec.incarnations["w1.1"].ended_at = 2.0
        rec.incarnations["w2.1"].ended_at = 5.0
        rec.incarnations["w2.2"] = Incarnation("w2.2", "w2", pid=2, started_at=5.5, ready_at=6.0)
        rec.faults += [FaultRecord("kill", "w1.1", 2.0, ended_at=12.0, replacement="w1.2"),
                       FaultRecord("kill_restart", "w2.1", 5.0, ended_at=6.0, replacement="w2.2")]
        msg = message(rec, "g01", 1, 1.0)
        stream(rec, msg, 1, "w1.1", 1.1, 2.0, whole=False, record=False)
        notice(rec, msg, "w2.1", 4.0, mid=5000)
        if resumed:
            rec.streams.append(Stream(2, "w2.1", 4.2, 5.0, False, msg.tag, resume=True))
        notice(rec, msg, "w2.2", 6.5, mid=5001)
        rec.transcripts["g01"] += [Row("assistant", "", "system", "worker stopped responding; session taken over")] * 2
        report = check(rec)
        assert ("double-takeover" in kinds(report)) is double, report.text()


def test_an_answer_recorded_but_never_confirmed_shown_may_be_shown_whole_again_by_its_new_owner() -> None:
    """Redis soak, seed 12: w2.1 recorded an answer and showed all but its last word; its lease was
    lost before the end was shown. w1.1 took the session over and showed the recorded answer whole,
    as a new message: another incarnation's stream in w1.1's call, and no violation. The same call
    without w1.1's acquisition, or partial, still is one."""
    def history(acquired: bool, whole: bool) -> Records:
        rec = records()
        msg = message(rec, "g01", 1, 1.0)
        lease(rec, 0.9, "acquire", "w2.1", fence=1)
        stream(rec, msg, 1, "w2.1", 1.1, 2.0, whole=False)  # shown up to its held-back last word
        rec.streams[-1].completed = True
        rec.transcripts["g01"][-1] = Row("assistant", "[g01_m1_c1] w0 w1 w2 END", None, None)  # recorded whole
        if acquired:
            lease(rec, 5.0, "acquire", "w1.1", fence=2)
        text = "[g01_m1_c1] w0 w1 w2" + (" END" if whole else "")
        rec.calls.append(TgCall(5.01, "w1.1", "sendMessage", msg.chat_id, 2000, text, msg.message_id))
        rec.bot_messages.append(BotMessage(msg.chat_id, 2000, "w1.1", 5.01, text, msg.message_id, 5.01))
        return rec

    report = check(history(acquired=True, whole=True))
    assert kinds(report) == {}, report.text()
    assert "shown again whole by w1.1" in report.text()
    assert kinds(check(history(acquired=False, whole=True))).get("foreign-stream-output") == 1
    assert kinds(check(history(acquired=True, whole=False))).get("foreign-stream-output") == 1
