"""The ``zeroshard`` command line.

Owns the entry point (:mod:`.main`: one module per subcommand, only the one run imported;
every error one line, exit status 0, 1, 2 or 3), the subcommands (``layout``: :mod:`.layout_report`;
``demo``: :mod:`.demo_cmd`, :mod:`.demo_moe_cmd`; ``inspect``: :mod:`.inspect_cmd` with
:mod:`.inspect_report`, :mod:`.export_report`, :mod:`.expert_report`; ``to-universal`` and
``to-fp32``: :mod:`.convert_cmd`), their argument types (:mod:`.arguments`) and error wording
(:mod:`.errors`).

May import: anything of zeroshard below it; nothing imports it but ``__main__`` and the
``zeroshard`` console script.
"""

from .main import main

__all__ = ["main"]
