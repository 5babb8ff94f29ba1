# SPDX-License-Identifier: Apache-2.0
"""Worker process: capture inside the model runner (:mod:`.capture`)."""
