// Command dsec builds, stores and runs stateful agent sandboxes.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/containerd/errdefs"
)

// Exit codes. One place decides them; every command's help lists them.
const (
	exitOK       = 0
	exitFailure  = 1  // I/O error, corruption, anything unexpected
	exitUsage    = 2  // bad flags, arguments or configuration
	exitBadInput = 3  // the input's content is invalid (corrupt archive, bad entry)
	exitNotFound = 4  // a layer, tag, file or blob does not exist
	exitExists   = 5  // the tag already exists (use --force)
	exitNoSpace  = 6  // the store's file system is full
	exitDenied   = 7  // a registry refused the credentials
	exitState    = 8  // the sandbox is in the wrong state (running, stopped)
	exitInfraErr = 9  // the worker or a sandbox failed (infrastructure, not input)
	exitBusy     = 10 // the host stayed at capacity for the admission queue's timeout
)

const exitCodesHelp = `Exit codes:
  0  success
  1  failure (I/O error, corrupt store, anything unexpected)
  2  usage error (bad flag, argument, tag or configuration)
  3  invalid input (corrupt or truncated archive, an entry a layer cannot hold, a snapshot over its limits)
  4  not found (layer, tag, source path or blob)
  5  already exists (a tag names other content; pass --force)
  6  no space left in the store's file system
  7  permission denied (registry credentials, or a worker's token, missing or refused)
  8  wrong state (a running sandbox to rm without -f, a stopped one to exec in), or not done here (a
     backend this host cannot run: no QEMU or guest kernel for microvm; an ability a backend lacks)
  9  infrastructure failure (the worker or the sandbox died; not your input)
  10 busy: the host stayed at capacity while the request waited in the admission queue, or a
     token's quota, or its requests at once, are spent`

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
	} else if err = cmd.ExecuteContext(ctx); errors.Is(err, errNeedFull) {
		err = handOver(args)
	}
	if err == nil {
		return exitOK
	}
	if strings.HasPrefix(err.Error(), "unknown command ") { // cobra's, untyped
		err = usageError{err}
	}
	var ce cmdExit
	if errors.As(err, &ce) { // a command's exit code, passed through
		return ce.code
	}
	fmt.Fprintf(stderr, "dsec: %s\n", userMessage(err))
	return exitCode(err)
}

// usageError marks a problem with the command line itself.
type usageError struct{ error }

// errNeedFull: the client build met input only the complete binary
// reads (a policy file), before doing anything; it hands the command over.
var errNeedFull = errors.New("needs dsec's complete binary")

func (u usageError) Unwrap() error { return u.error }

func exitCode(err error) int {
	var u usageError
	var coded *codedError
	switch {
	case errors.As(err, &coded):
		return coded.code
	case errors.As(err, &u):
		return exitUsage
	case isNoSpace(err):
		return exitNoSpace
	case errdefs.IsNotFound(err), errors.Is(err, fs.ErrNotExist):
		return exitNotFound
	case errdefs.IsPermissionDenied(err), errdefs.IsUnauthorized(err):
		return exitDenied
	case errdefs.IsAlreadyExists(err):
		return exitExists
	case errdefs.IsFailedPrecondition(err), errdefs.IsNotImplemented(err):
		return exitState
	case errdefs.IsUnavailable(err):
		return exitInfraErr
	case errdefs.IsResourceExhausted(err):
		return exitBusy
	case errdefs.IsOutOfRange(err):
		return exitBadInput
	case errdefs.IsInvalidArgument(err):
		if isBadInput(err) {
			return exitBadInput
		}
		return exitUsage
	}
	return exitFailure
}

// userMessage drops the errdefs class names that wrapping appends.
func userMessage(err error) string {
	msg := err.Error()
	for _, suffix := range []string{": not found", ": already exists", ": invalid argument", ": data loss", ": not implemented", ": permission denied", ": failed precondition", ": unavailable", ": out of range", ": resource exhausted", ": unknown", ": conflict", ": canceled", ": aborted"} {
		msg = strings.TrimSuffix(msg, suffix)
	}
	if isNoSpace(err) {
		msg += " (free space on the store's file system or choose another --root)"
	}
	return msg
}
