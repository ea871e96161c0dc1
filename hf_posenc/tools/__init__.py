"""The tools built on the library: the ``hf-posenc`` command and what its subcommands share.

Nothing in the library imports from here."""
