"""What a process is told: the configuration (flags, environment, file) with its checks and
defaults (:mod:`~projector.settings.config`), secrets kept out of what is printed
(:mod:`~projector.settings.redaction`), and how it logs (:mod:`~projector.settings.logs`)."""
