package main

import (
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/dsec-project/dsec/api"
)

func (a *app) gradeCommand() *cobra.Command {
	var req api.GradeRequest
	var asJSON, quiet bool
	cmd := &cobra.Command{
		Use:   "grade [flags] SANDBOX --grader LAYER -- CMD [ARG...]",
		Short: "Grade a sandbox in a fresh one, on only what the carry rules take of its changes",
		Long: `Grade runs the grader's command in a sandbox of its own, never in the agent's: the sandbox's
own layers (pristine, as it was made), what the carry rules take of what the agent changed
(what it wrote, over the snapshots it was started on), and the grader's layers on top, with no
network and none of the agent's processes. The agent's sandbox is frozen only while its changes
are read, and runs on unchanged.

The carry rules (--carry, repeated; else the policy's grading.carry) are absolute glob patterns
of the paths that are the agent's answer, "!" in front of those never carried: '/work/repo/**'
'!/work/repo/tests/**'. "*" matches within a path segment, "**" whole segments. Interpreters'
startup hooks and bytecode (conftest.py, pytest.ini, sitecustomize.py, usercustomize.py, *.pth,
__pycache__, *.pyc) are never carried unless the policy's grading.never says otherwise; nor is a
symlink out of the carried paths, a device node, a fifo, a socket, or a file over
grading.maxFileBytes (default 64M).

The answer has the grader's exit code and output, the JSON it wrote to $DSEC_GRADE_RESULT
(default /tmp/dsec-grade.json), and a tamper report: every path the agent changed that the grade
left out, grouped (tests, hooks, path, toolkit, guarded, pseudo, links, special, huge, other),
with sizes and digests, and how many processes still ran in its sandbox. --id makes the grade
exactly-once: the same id answers what it answered, without grading again.

The grader's output goes to stdout and stderr, the summary and report to stderr; --json prints
the whole answer as one JSON object instead. dsec exits with the grader's exit code.

` + runExitHelp,
		Example: `  dsec grade rollout-7 --grader grader:1 --carry '/work/repo/**' --carry '!/work/repo/tests/**' -- /opt/grader/run
  dsec grade rollout-7 --grader grader:1 --id step-40 --json -- pytest -q /work/repo/tests`,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) < 2 || cmd.ArgsLenAtDash() != 1 {
				return usageError{errors.New("grade needs a sandbox and the grader's command: dsec grade SANDBOX --grader LAYER -- CMD [ARG...]")}
			}
			return nil
		},
		ValidArgsFunction: a.completeSandboxes,
		RunE: func(cmd *cobra.Command, args []string) error {
			if len(req.Grader) == 0 {
				return usageError{errors.New("grade needs --grader LAYER: the grader's layer, which the agent could not touch")}
			}
			req.Args = args[1:]
			c, err := a.client()
			if err != nil {
				return runError(err)
			}
			g, err := c.Sandbox(args[0]).Grade(cmd.Context(), req)
			if err != nil {
				return runError(err)
			}
			if asJSON {
				if err := a.printJSON(g); err != nil {
					return err
				}
			} else {
				fmt.Fprint(a.stdout, g.Stdout)
				fmt.Fprint(a.stderr, g.Stderr)
				if !quiet {
					a.printGrade(g)
				}
			}
			if g.ExitCode != 0 {
				return cmdExit{g.ExitCode}
			}
			return nil
		},
	}
	fl := cmd.Flags()
	fl.StringArrayVar(&req.Grader, "grader", nil, "the grader's layer, topmost first (repeat for more)")
	fl.StringArrayVar(&req.Carry, "carry", nil, "a carry rule: an absolute glob of the agent's answer, ! to exclude (repeat; default: the policy's grading.carry)")
	fl.StringVar(&req.ID, "id", "", "the grade's id: a retry with it answers what it answered (default: fresh)")
	fl.StringArrayVarP(&req.Env, "env", "e", nil, "set an environment variable for the grader, KEY=VALUE (repeat)")
	fl.StringVarP(&req.Cwd, "workdir", "w", "", "the grader's working directory (default: the sandbox's)")
	fl.StringVarP(&req.User, "user", "u", "", "run the grader as this user (default: the sandbox's)")
	fl.IntVar(&req.Timeout, "timeout", 0, "kill the grader after this many seconds (default 600)")
	fl.StringVar(&req.Result, "result", "", "where the grader writes its JSON result (default "+api.DefaultGradeResult+")")
	fl.BoolVar(&asJSON, "json", false, "print the whole answer as JSON")
	fl.BoolVarP(&quiet, "quiet", "q", false, "print the grader's output only")
	return cmd
}

// printGrade writes a grade's summary and tamper report to stderr.
func (a *app) printGrade(g *api.Grade) {
	secs := func(s float64) time.Duration { return time.Duration(s * float64(time.Second)).Round(time.Millisecond) }
	verdict := "passed"
	if g.ExitCode != 0 {
		verdict = "failed"
	}
	if g.TimedOut {
		verdict = "timed out"
	}
	fmt.Fprintf(a.stderr, "grade %s of %s: %s (exit %d); carried %d paths, %s; frozen %s, started %s, graded %s\n", g.ID, g.Sandbox, verdict,
		g.ExitCode, g.Carried.Paths, humanBytes(g.Carried.Bytes), secs(g.FrozenSeconds), secs(g.StartSeconds), secs(g.GraderSeconds))
	if len(g.Result) > 0 {
		fmt.Fprintf(a.stderr, "result: %s\n", strings.TrimSpace(string(g.Result)))
	} else if g.ResultError != "" {
		fmt.Fprintf(a.stderr, "result: none taken: %s\n", g.ResultError)
	}
	t := g.Tamper
	var groups []string
	for name, n := range t.Groups {
		groups = append(groups, fmt.Sprintf("%s %d", name, n))
	}
	sort.Strings(groups)
	procs := fmt.Sprintf("%d processes still ran", t.Processes)
	if t.Processes < 0 {
		procs = "its guest's processes not counted"
	}
	fmt.Fprintf(a.stderr, "left out: %d paths (%s); %s\n", len(t.Paths)+t.Truncated, strings.Join(groups, ", "), procs)
	for _, p := range t.Paths {
		line := fmt.Sprintf("  %-8s %-8s %-8s %s", p.Group, p.Change, p.Type, p.Path)
		if p.Target != "" {
			line += " -> " + p.Target
		}
		if p.Type == "file" && p.Change != "removed" {
			line += " (" + humanBytes(p.Size) + ")"
		}
		if p.Why != "" {
			line += ": " + p.Why
		}
		fmt.Fprintln(a.stderr, line)
	}
	if t.Truncated > 0 {
		fmt.Fprintf(a.stderr, "  ... and %d more\n", t.Truncated)
	}
}
