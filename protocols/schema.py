"""Write the JSON Schema of every wire message: ``python -m protocols.schema > schema.json``."""

from __future__ import annotations

import json
import sys

import protocols


def all_message_types() -> list[type]:
    return [
        protocols.PromptGroup,
        protocols.Completion,
        protocols.Control,
        protocols.ScoredSample,
        protocols.MicrobatchHeader,
        protocols.TrajectoryRecord,
        protocols.RewardRequest,
        protocols.RewardReply,
        protocols.TeacherRequest,
        protocols.TeacherReply,
        protocols.EnvReset,
        protocols.EnvStep,
        protocols.EnvClose,
        protocols.EnvReply,
    ]


def main() -> None:
    json.dump(protocols.json_schema(all_message_types()), sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
