"""``ppokit config show|list|fields``: a resolved config, the presets, every field explained."""

from __future__ import annotations

import argparse
import sys

from ppokit.commands.arguments import add_command


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(subparsers, "config", run, help="show, list and explain configurations")
    actions = parser.add_subparsers(dest="config_command", metavar="ACTION")
    show = add_command(actions, "show", None, help="print the resolved config of a preset or YAML file")
    show.add_argument("config", metavar="NAME", help="preset name or YAML path")
    show.add_argument("overrides", nargs="*", default=[], metavar="KEY=VALUE")
    add_command(actions, "list", None, help="list the built-in presets")
    add_command(actions, "fields", None, help="every config field with its default, aliases and description")


def run(args: argparse.Namespace) -> int:
    from ppokit import config as config_mod
    from ppokit.workloads import describe, workload_kind

    if args.config_command == "show":
        print(config_mod.load_config(args.config, args.overrides).to_yaml(), end="")
    elif args.config_command == "list":
        names = config_mod.preset_names()
        width = max(map(len, names))
        for name in names:
            cfg = config_mod.load_config(name)
            print(f"{name:{width}s} {workload_kind(cfg):8s} {describe(cfg)}")
    elif args.config_command == "fields":
        for path, default, aliases, description in config_mod.describe_fields():
            alias_text = f"  (aliases: {aliases})" if aliases else ""
            print(f"{path} = {default}\n    {description}{alias_text}")
    else:
        print("usage: ppokit config {show NAME,list,fields}", file=sys.stderr)
        return 2
    return 0
