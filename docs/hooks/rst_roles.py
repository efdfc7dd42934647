"""mkdocs hook: show the Sphinx roles of genback's docstrings as plain code.

The docstrings are written for both ``help()`` and this site and use Sphinx cross-reference roles
(``:class:`~genback.engine.session.GenbackSession```). Markdown renders those as the role name
followed by a code span; this hook drops the role and, for ``~``, keeps only the last dotted
component, as Sphinx does.
"""

from __future__ import annotations

import re

_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|attr|exc|data|obj|const):<code>(~?)([^<]*)</code>")


def _plain(match: re.Match) -> str:
    tilde, target = match.groups()
    return f"<code>{target.rsplit('.', 1)[-1] if tilde else target}</code>"


def on_page_content(html: str, page, config, files) -> str:  # noqa: ARG001 - mkdocs hook signature
    return _ROLE.sub(_plain, html)
