//go:build !front

package main

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/store"
	"github.com/dsec-project/dsec/sdk"
)

// workerError is an error as the SDK gives a worker's answer.
func workerError(class, msg string) error {
	return &sdk.Error{API: api.Error{Class: class, Message: msg}}
}

// TestExitCode: every row of errorClasses in both of its columns, every
// command's and run's and exec's own failures', and an error of no class;
// the codes are the ones the help texts list.
func TestExitCode(t *testing.T) {
	cases := []struct {
		class     string // the row that decides ("": none)
		err       error
		code, run int
	}{
		{"usage", usageError{errors.New("bad flag")}, exitUsage, exitUsage},
		{"usage", usageError{fmt.Errorf("bad ref: %w", errdefs.ErrNotFound)}, exitUsage, exitUsage},
		{"no space", fmt.Errorf("write blob: %w", store.ErrNoSpace), exitNoSpace, exitDsec},
		{"not found", fmt.Errorf("layer a:1: %w", errdefs.ErrNotFound), exitNotFound, exitDsec},
		{"not found", &fs.PathError{Op: "open", Path: "/x", Err: fs.ErrNotExist}, exitNotFound, exitDsec},
		{"not found", workerError(api.ClassNotFound, "sandbox a: not found"), exitNotFound, exitDsec},
		{"denied", fmt.Errorf("pull: %w", errdefs.ErrPermissionDenied), exitDenied, exitDsec},
		{"denied", fmt.Errorf("no token: %w", errdefs.ErrUnauthenticated), exitDenied, exitDsec},
		{"exists", fmt.Errorf("tag a:1: %w", errdefs.ErrAlreadyExists), exitExists, exitDsec},
		{"state", workerError(api.ClassState, "sandbox a is stopped"), exitState, exitDsec},
		{"state", fmt.Errorf("evict: %w", errdefs.ErrNotImplemented), exitState, exitDsec},
		{"infra", fmt.Errorf("lost the worker: %w", sdk.ErrInfra), exitInfraErr, exitInfra},
		{"infra", workerError(api.ClassInfra, "the sandbox died"), exitInfraErr, exitInfra},
		{"infra", fmt.Errorf("qemu: %w", errdefs.ErrUnavailable), exitInfraErr, exitInfra},
		{"busy", workerError(api.ClassBusy, "at capacity"), exitBusy, exitBusy},
		{"out of range", fmt.Errorf("snapshot over its limits: %w", errdefs.ErrOutOfRange), exitBadInput, exitDsec},
		{"bad input", fmt.Errorf("%w: read tar: unexpected EOF", layer.ErrBadSource), exitBadInput, exitUsage},
		{"invalid", fmt.Errorf("bad name: %w", errdefs.ErrInvalidArgument), exitUsage, exitUsage},
		{"", errors.New("disk on fire"), exitFailure, exitDsec},
		{"", fmt.Errorf("state: %w", errdefs.ErrDataLoss), exitFailure, exitDsec},
	}
	rows := map[string]bool{}
	for _, c := range cases {
		rows[c.class] = true
		class := ""
		for _, r := range errorClasses {
			if r.is(c.err) {
				class = r.name
				break
			}
		}
		if class != c.class {
			t.Errorf("%v: of class %q, want %q", c.err, class, c.class)
		}
		if got := exitCode(c.err); got != c.code {
			t.Errorf("%v: exit code %d, want %d", c.err, got, c.code)
		}
		if got := exitCode(runError(c.err)); got != c.run {
			t.Errorf("%v: run's and exec's exit code %d, want %d", c.err, got, c.run)
		}
		if got := exitCode(fmt.Errorf("step 3: %w", runError(c.err))); got != c.run {
			t.Errorf("%v wrapped again: run's and exec's exit code %d, want %d", c.err, got, c.run)
		}
	}
	for _, r := range errorClasses {
		if !rows[r.name] {
			t.Errorf("no case of class %q", r.name)
		}
		if r.code == exitOK || r.code == exitFailure || r.run == exitDsec {
			t.Errorf("class %q gives the code of no class", r.name)
		}
		if !strings.Contains(exitCodesHelp, fmt.Sprintf("\n  %-2d ", r.code)) {
			t.Errorf("exit code %d of class %q is not in the exit code help", r.code, r.name)
		}
		if r.run != 0 && !regexp.MustCompile(fmt.Sprintf(`\b%d (for|if)\b`, r.run)).MatchString(runExitHelp) {
			t.Errorf("run's and exec's exit code %d of class %q is not in their help", r.run, r.name)
		}
	}
	for _, code := range []int{exitDsec, exitInfra} {
		if !strings.Contains(runExitHelp, fmt.Sprintf("%d if", code)) {
			t.Errorf("run's and exec's exit code %d is not in their help", code)
		}
	}
	// A command's exit code passes through run and exec.
	if err := runError(cmdExit{3}); err != (cmdExit{3}) {
		t.Errorf("runError(cmdExit{3}) = %#v", err)
	}
	if err := runError(nil); err != nil {
		t.Errorf("runError(nil) = %v", err)
	}
}

// TestErrorMessage: a message drops the class text that wrapping an
// error of the class appended, and only that.
func TestErrorMessage(t *testing.T) {
	for _, class := range classTexts {
		err := fmt.Errorf("layer a:1: %w", class)
		if got := userMessage(err); got != "layer a:1" {
			t.Errorf("%q: message %q, want %q", err, got, "layer a:1")
		}
	}
	for _, c := range []struct {
		err  error
		want string
	}{
		{runError(fmt.Errorf("layer a:1: %w", errdefs.ErrNotFound)), "layer a:1"},
		{workerError(api.ClassNotFound, "sandbox a: not found"), "sandbox a"},
		{workerError(api.ClassExists, "sandbox a: already exists"), "sandbox a"},
		{fmt.Errorf("no answer from the worker: %w", sdk.ErrInfra), "no answer from the worker: infrastructure failure"},
		{workerError(api.ClassInfra, "the sandbox died: infrastructure failure: unavailable"), "the sandbox died: infrastructure failure"},
		// Words of a class the error is not of stay.
		{errors.New("the file was not found"), "the file was not found"},
		{errors.New("remote says: not found"), "remote says: not found"},
		{workerError(api.ClassState, "sandbox a: not found"), "sandbox a: not found"},
		{fmt.Errorf("the worker takes a token: %w", errdefs.ErrUnauthenticated), "the worker takes a token: unauthorized"},
		{fmt.Errorf("%w: read tar: unexpected EOF", layer.ErrBadSource), "bad source: read tar: unexpected EOF"},
		{fmt.Errorf("write blob: %w", store.ErrNoSpace), "write blob: no space left in the store (free space on the store's file system or choose another --root)"},
	} {
		if got := userMessage(c.err); got != c.want {
			t.Errorf("%q: message %q, want %q", c.err, got, c.want)
		}
	}
}

// TestUsageUnknownCommand: a command line naming no command, and
// arguments cobra's own commands refuse, are usage errors with cobra's
// message; shell completion's hidden command still runs.
func TestUsageUnknownCommand(t *testing.T) {
	config := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(config, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Setenv("DSEC_CONFIG", config)
	t.Setenv("DSEC_ROOT", t.TempDir())
	for _, c := range []struct {
		args   []string
		code   int
		stdout string
		stderr string
	}{
		{[]string{"no-such-command"}, exitUsage, "", `dsec: unknown command "no-such-command" for "dsec"` + "\n"},
		{[]string{"--log-level", "info", "versio"}, exitUsage, "", "dsec: unknown command \"versio\" for \"dsec\"\n\nDid you mean this?\n\tversion\n\n"},
		{[]string{"completion", "bash", "extra"}, exitUsage, "", `dsec: unknown command "extra" for "dsec completion bash"` + "\n"},
		{[]string{"version", "extra"}, exitUsage, "", "dsec: dsec version takes no arguments, not 1: usage: dsec version [flags] (see --help)\n"},
		{[]string{"__complete", "versi"}, exitOK, "version\tPrint dsec's version", ""},
	} {
		var stdout, stderr bytes.Buffer
		code := Main(c.args, strings.NewReader(""), &stdout, &stderr)
		if code != c.code || !strings.HasPrefix(stdout.String(), c.stdout) || (c.code != exitOK && stderr.String() != c.stderr) {
			t.Errorf("dsec %s: exit %d, stdout %q, stderr %q; want exit %d, stdout %q..., stderr %q",
				strings.Join(c.args, " "), code, stdout.String(), stderr.String(), c.code, c.stdout, c.stderr)
		}
	}
}
