package main

import (
	"errors"
	"fmt"
	"io/fs"
	"strings"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/sdk"
)

// Exit codes. One place decides them (errorClasses); every command's
// help lists them.
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

// Exit codes of run and exec, which otherwise exit with the command's.
const (
	exitDsec  = 125 // dsec could not run the command (unknown sandbox, ...)
	exitInfra = 255 // the sandbox or the worker failed under the command
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

const runExitHelp = `Exit codes: the command's own exit code (128+N if a signal N killed it, 127 if it
was not found in the sandbox); 2 for a bad command line; 125 if dsec could not run it (unknown
sandbox or layer, a stopped sandbox: the message says which); 10 if the host stayed at capacity for
the admission queue's timeout; 137 if dsec stop killed it; 255 if the sandbox or the worker failed
under it (an infrastructure failure: the step says nothing about the command; retry it with
the same --id to collect its result if it ran).`

// errorClasses is the one map from an error's class to dsec's exit
// code. An error is matched against the rows in order, the first class
// it is of deciding. code is what every command exits with (exitFailure
// for an error of no class). run is what run and exec exit with for a
// failure of their own (runError), not of the command, whose code is
// theirs otherwise: 0 where they do not tell the class apart, so a later
// row decides, or exitDsec if none does.
var errorClasses = []struct {
	name string
	is   func(error) bool
	code int
	run  int
}{
	{"usage", isUsage, exitUsage, exitUsage},
	{"no space", isNoSpace, exitNoSpace, 0},
	{"not found", isNotFound, exitNotFound, 0},
	{"denied", isDenied, exitDenied, 0},
	{"exists", errdefs.IsAlreadyExists, exitExists, 0},
	{"state", isState, exitState, 0},
	{"infra", sdk.IsInfra, exitInfraErr, exitInfra},
	{"busy", errdefs.IsResourceExhausted, exitBusy, exitBusy},
	{"out of range", errdefs.IsOutOfRange, exitBadInput, 0},
	{"bad input", isBadInput, exitBadInput, exitUsage}, // an invalid argument, of the input's content
	{"invalid", errdefs.IsInvalidArgument, exitUsage, exitUsage},
}

func isUsage(err error) bool {
	var u usageError
	return errors.As(err, &u)
}

func isNotFound(err error) bool {
	return errdefs.IsNotFound(err) || errors.Is(err, fs.ErrNotExist)
}

func isDenied(err error) bool {
	return errdefs.IsPermissionDenied(err) || errdefs.IsUnauthorized(err)
}

// isState: the wrong state, or not done here.
func isState(err error) bool {
	return errdefs.IsFailedPrecondition(err) || errdefs.IsNotImplemented(err)
}

// exitCode is the code dsec exits with for err: run's and exec's
// column for their own failures, every command's otherwise.
func exitCode(err error) int {
	var rf runFailure
	run := errors.As(err, &rf)
	for _, c := range errorClasses {
		code := c.code
		if run {
			code = c.run
		}
		if code != 0 && c.is(err) {
			return code
		}
	}
	if run {
		return exitDsec
	}
	return exitFailure
}

// usageError marks a problem with the command line itself.
type usageError struct{ error }

func (u usageError) Unwrap() error { return u.error }

// cmdExit makes dsec exit with a command's code, silently.
type cmdExit struct{ code int }

func (e cmdExit) Error() string { return fmt.Sprintf("exit %d", e.code) }

// runFailure is a failure of run or exec itself, not of its command:
// exitCode takes its code from errorClasses' run column.
type runFailure struct{ error }

func (r runFailure) Unwrap() error { return r.error }

// runError marks run's and exec's own failures; a command's exit code
// passes through.
func runError(err error) error {
	var ce cmdExit
	if err == nil || errors.As(err, &ce) {
		return err
	}
	return runFailure{err}
}

// classTexts are the errdefs classes whose text a message to the user
// goes without: the exit code says the class. Wrapping an error of a
// class with %w appends its sentinel's text ("layer a:1: not found"),
// and a worker's answer carries that text too: api.ErrorOf sends the
// error's whole text as the message, its class beside it, and the
// sdk.Error made of it unwraps to the class's sentinel again. Errors
// made without the text instead would change every package's messages
// and the API's; so the text is dropped here, as the sentinel itself
// says it, and only from an error errors.Is finds of that class (a
// message that merely ends with the words keeps them).
// ErrUnauthenticated is not among them: its text ("unauthorized") is
// printed.
var classTexts = []error{
	errdefs.ErrNotFound, errdefs.ErrAlreadyExists, errdefs.ErrInvalidArgument, errdefs.ErrDataLoss,
	errdefs.ErrNotImplemented, errdefs.ErrPermissionDenied, errdefs.ErrFailedPrecondition,
	errdefs.ErrUnavailable, errdefs.ErrOutOfRange, errdefs.ErrResourceExhausted, errdefs.ErrUnknown,
	errdefs.ErrConflict, errdefs.ErrAborted,
}

// userMessage is err as dsec prints it: without the class texts that
// wrapping appends, and with what to do about a full store.
func userMessage(err error) string {
	msg := err.Error()
	for _, class := range classTexts {
		if errors.Is(err, class) {
			msg = strings.TrimSuffix(msg, ": "+class.Error())
		}
	}
	if isNoSpace(err) {
		msg += " (free space on the store's file system or choose another --root)"
	}
	return msg
}
