"""Which Telegram messages are for us, decided without a bot: the command rules on their own."""

from __future__ import annotations

from gateway.core.messages import ChatType
from platforms.telegram_intake import CommandFor, command_for

BOT = "switchboard_bot"


def test_a_command_is_ours_unless_it_names_another_bot_or_is_an_unknown_bare_one_in_a_group() -> None:
    assert command_for("hello /stop", BOT, ChatType.GROUP) is CommandFor.NO_COMMAND
    assert command_for("/stop", BOT, ChatType.GROUP) is CommandFor.US
    assert command_for(f"/stop@{BOT}", BOT, ChatType.GROUP) is CommandFor.US
    assert command_for("/stop@OtherBot", BOT, ChatType.DM) is CommandFor.ANOTHER_BOT
    # An unknown bare command: in a group most likely another bot's; in a private chat, ours
    # (answered with "unknown command"); named after us, ours anywhere.
    assert command_for("/roll 2d6", BOT, ChatType.GROUP) is CommandFor.ANOTHER_BOT
    assert command_for("/roll 2d6", BOT, ChatType.DM) is CommandFor.US
    assert command_for(f"/roll@{BOT} 2d6", BOT, ChatType.GROUP) is CommandFor.US
