"""Errors caused by what a user gave us (a config field, a trace line, a CLI flag).

The CLI turns any ``UserInputError`` into its message on stderr and exit code 2, without a
traceback; the message must name the field, flag or line at fault."""


class UserInputError(ValueError):
    pass
