"""``hf-posenc methods [NAME]``: the positional methods and their options; with a name, each option's default and
meaning (read from the comments beside the fields of the method's config dataclass)."""

from __future__ import annotations

import dataclasses
import inspect
import re
import shutil
import sys
import textwrap

FIELD = re.compile(r"^\s+(\w+)\s*:[^=#]*(?:=[^#]*)?(?:#\s*(.*))?$")
COMMENT = re.compile(r"^\s+#\s?(.*)$")


def field_comments(config_class: type) -> dict[str, str]:
    """Option name -> the comment beside its field (on its line, or the comment lines just above it), from the
    config class and the classes it inherits from."""
    comments: dict[str, str] = {}
    for cls in reversed(config_class.__mro__):
        try:
            lines = inspect.getsource(cls).splitlines()
        except (OSError, TypeError):
            continue
        above: list[str] = []
        for line in lines[1:]:
            comment, field = COMMENT.match(line), FIELD.match(line)
            if comment:
                above.append(comment.group(1).strip())
            elif field:
                text = " ".join(part for part in (*above, field.group(2) or "") if part)
                if text:
                    comments[field.group(1)] = text
                above = []
            else:
                above = []
    return comments


def list_methods() -> None:
    import hf_posenc

    for name in hf_posenc.available_methods():
        print(f"{name:<14} {', '.join(hf_posenc.get_method(name).config_class.option_names()) or '-'}")
    print("hf-posenc methods NAME: one method's options, with defaults and meaning", file=sys.stderr)


def describe_method(name: str) -> None:
    import hf_posenc

    config_class = hf_posenc.get_method(name.lower()).config_class
    for cls in config_class.__mro__[:-2]:  # the config classes, not PosEncConfig's own doc nor object's
        doc = inspect.getdoc(cls) or ""
        if cls.__dict__.get("__doc__") and not doc.startswith(cls.__name__ + "("):  # not a dataclass's signature
            print(doc.split("\n\n")[0].replace("\n", " "))
    print(f"options of {name!r} ({config_class.__name__}); use as hf_posenc.patch_model(model, {name!r}, KEY=VALUE) "
          f"or --method {name}:KEY=VALUE,...")
    comments = field_comments(config_class)
    fields = {f.name: f for f in dataclasses.fields(config_class)}
    width = max(60, shutil.get_terminal_size().columns)
    name_width = max(len(option) for option in config_class.option_names()) if fields else 0
    for option in config_class.option_names():
        field = fields[option]
        default = field.default if field.default is not dataclasses.MISSING else (
            field.default_factory() if field.default_factory is not dataclasses.MISSING else "(required)")
        head = f"  {option:<{name_width}}  default {default!r:<9} "
        print(textwrap.fill(comments.get(option, "-"), width, initial_indent=head,
                            subsequent_indent=" " * len(head)))
