// Command dsec builds, stores and runs stateful agent sandboxes.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"
)

var version = "dev"

func main() {
	beforeMain()
	os.Exit(Main(os.Args[1:], os.Stdin, os.Stdout, os.Stderr))
}

// Main runs dsec with args and returns its exit code.
func Main(args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	app := newApp(stdin, stdout, stderr)
	cmd := app.rootCommand()
	cmd.SetArgs(args)
	var err error
	if !app.handles(cmd, args) { // the client build lacks the command
		err = handOver(args)
	} else if err = execute(ctx, cmd, args); errors.Is(err, errNeedFull) {
		err = handOver(args)
	}
	if err == nil {
		return exitOK
	}
	var ce cmdExit
	if errors.As(err, &ce) { // a command's exit code, passed through
		return ce.code
	}
	fmt.Fprintf(stderr, "dsec: %s\n", userMessage(err))
	return exitCode(err)
}

// execute runs the command args name. cobra's errors about the command
// line itself are untyped; they become usage errors here by where they
// arise, not by their text:
//   - a name no command has: Find, Execute's first step, failed. It is
//     asked again after Execute, on the same tree (with the help,
//     completion and __complete commands Execute adds) and the same
//     args, so it fails alike, and only then;
//   - arguments a command's validator refuses: dsec's validators give
//     usage errors already, cobra's own (its completion commands take no
//     arguments) are made to.
func execute(ctx context.Context, root *cobra.Command, args []string) error {
	root.InitDefaultCompletionCmd(args...) // as Execute does, earlier: to reach its validators
	if c, _, err := root.Find(args); err == nil {
		if refuse := c.Args; refuse != nil { // the command args name, alone: the others do not run
			c.Args = func(cmd *cobra.Command, args []string) error {
				err := refuse(cmd, args)
				if err != nil && !isUsage(err) {
					return usageError{err}
				}
				return err
			}
		}
	}
	err := root.ExecuteContext(ctx)
	if err != nil {
		if _, _, ferr := root.Find(args); ferr != nil {
			return usageError{err}
		}
	}
	return err
}

// errNeedFull: the client build met input only the complete binary
// reads (a policy file), before doing anything; it hands the command over.
var errNeedFull = errors.New("needs dsec's complete binary")
