"""What counts as a reference to the project's own planning documents or issue numbers,
which a later maintainer cannot follow: ``SPEC`` (a section of the planning sheet, as in
"SPEC 1.4" or "../shared/SPEC.md") and "issue 26", "issues 26-30", "(issue #15)".

Kept tight so that it flags none of the real upstream references the code cites: a pull
request ("DeepGEMM PR #323"), an issue URL of an upstream project (".../issues/1234"), an
identifier that contains the letters (``_SPEC``, ``importlib.util.spec_from_file_location``)
or the words "issue rate" and "issued".
"""

import re

INTERNAL_REFERENCE = re.compile(r"\bSPEC\b|\b[Ii]ssues? #?\d")
