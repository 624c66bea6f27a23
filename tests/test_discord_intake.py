"""Which Discord guild messages are for the bot without a mention: the channel rule on its own."""

from __future__ import annotations

from gateway.core.messages import ChatRef, ChatType
from platforms.config import DiscordConfig
from platforms.discord_intake import open_channel

CHANNEL = ChatRef("discord", "10", ChatType.GROUP)
THREAD = ChatRef("discord", "10", ChatType.GROUP, "11")
OTHER = ChatRef("discord", "20", ChatType.GROUP)


def test_in_all_mode_every_message_of_an_allowed_channel_or_thread_is_for_the_bot() -> None:
    assert not open_channel(CHANNEL, DiscordConfig(guild_mode="mention"))
    assert open_channel(OTHER, DiscordConfig(guild_mode="all"))  # no list: every channel
    listed = DiscordConfig(guild_mode="all", allowed_channels=["10"])
    assert open_channel(CHANNEL, listed) and open_channel(THREAD, listed)  # a thread of an allowed channel
    assert not open_channel(OTHER, listed)
    only_thread = DiscordConfig(guild_mode="all", allowed_channels=["11"])
    assert open_channel(THREAD, only_thread) and not open_channel(CHANNEL, only_thread)
