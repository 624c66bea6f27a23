"""Operations: the daemon, configuration, the command line, HTTP listeners, systemd."""
