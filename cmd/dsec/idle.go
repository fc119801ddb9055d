package main

import (
	"errors"
	"fmt"
	"time"

	"github.com/spf13/cobra"
)

func (a *app) idleCommand() *cobra.Command {
	var expected time.Duration
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "idle NAME... [--for DURATION]",
		Short: "Hint that sandboxes wait for the model: frozen, memory given back, until their next exec",
		Long: `Idle tells the worker each sandbox will wait about --for (the model's next turn). One expected
to wait at least reclaim.hint_min_wait (2s) is frozen where it is and its memory given back to
the host: its page cache, and on a host with swap (a compressed tier such as zram) its cold
anonymous memory. It still shows running; its next exec resumes it first, so the caller sees no
difference but that exec's latency. A shorter wait leaves it as it is; commands running in it (an agent's server or interpreter) freeze with it.

` + exitCodesHelp,
		Example: `  dsec idle rollout-7 --for 30s
  dsec idle $(dsec ps -q) --for 1m`,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				return usageError{errors.New("idle needs the sandboxes' names")}
			}
			return nil
		},
		ValidArgsFunction: a.completeSandboxes,
		RunE: func(cmd *cobra.Command, args []string) error {
			if expected <= 0 {
				return usageError{errors.New("idle needs --for DURATION, how long the sandbox is expected to wait (e.g. 30s)")}
			}
			c, err := a.client()
			if err != nil {
				return err
			}
			var reports []any
			for _, name := range args {
				rep, err := c.Sandbox(name).Idle(cmd.Context(), expected)
				if err != nil {
					return err
				}
				if asJSON {
					reports = append(reports, map[string]any{"name": name, "report": rep})
					continue
				}
				state := "left running (too short a wait to be worth a resume)"
				if rep.Frozen {
					state = "frozen until its next exec"
				}
				fmt.Fprintf(a.stdout, "%s\t%s; memory %s -> %s\n", name, state, humanBytes(rep.MemoryBefore), humanBytes(rep.MemoryAfter))
			}
			if asJSON {
				return a.printJSON(reports)
			}
			return nil
		},
	}
	cmd.Flags().DurationVar(&expected, "for", 0, "how long the sandbox is expected to wait (required)")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print each report as JSON")
	return cmd
}
