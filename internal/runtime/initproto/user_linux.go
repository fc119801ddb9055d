package initproto

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"syscall"
)

// A command's user: a name of the sandbox's /etc/passwd or a uid, and
// optionally :group, a gid or a name of its /etc/group, resolved by the init inside the sandbox's root (the worker
// never reads the sandbox's files for it).

// account is a user as a command runs as it.
type account struct {
	name string
	cred syscall.Credential
	home string
}

// lookupUser resolves spec against /etc/passwd and /etc/group (of the
// root the init has pivoted into).
func lookupUser(spec string) (account, error) {
	name, group, hasGroup := strings.Cut(spec, ":")
	a := account{name: name, home: "/"}
	uid, err := strconv.ParseUint(name, 10, 32)
	numeric := err == nil
	found := false
	for _, f := range readColon("/etc/passwd") { // name:x:uid:gid:gecos:home:shell
		if len(f) < 7 {
			continue
		}
		if numeric && f[2] == name || !numeric && f[0] == name {
			u, err1 := strconv.ParseUint(f[2], 10, 32)
			g, err2 := strconv.ParseUint(f[3], 10, 32)
			if err1 != nil || err2 != nil {
				continue
			}
			a.name, a.home, found = f[0], f[5], true
			a.cred = syscall.Credential{Uid: uint32(u), Gid: uint32(g)}
			break
		}
	}
	switch {
	case !found && !numeric:
		return account{}, fmt.Errorf("no user %q in the sandbox's /etc/passwd: give a user it has, or a uid", name)
	case !found:
		a.cred = syscall.Credential{Uid: uint32(uid), Gid: uint32(uid)}
	}
	if hasGroup {
		g, err := lookupGroup(group)
		if err != nil {
			return account{}, fmt.Errorf("%w (in user %q)", err, spec)
		}
		a.cred.Gid = g
	} else if found {
		for _, f := range readColon("/etc/group") { // name:x:gid:members
			if len(f) < 4 {
				continue
			}
			for _, m := range strings.Split(f[3], ",") {
				if m == a.name {
					if g, err := strconv.ParseUint(f[2], 10, 32); err == nil {
						a.cred.Groups = append(a.cred.Groups, uint32(g))
					}
				}
			}
		}
	}
	if a.cred.Groups == nil {
		a.cred.Groups = []uint32{}
	}
	return a, nil
}

// lookupGroup resolves a group, a gid or a name of /etc/group, as an
// image's config may give it (user:group, uid:group).
func lookupGroup(group string) (uint32, error) {
	if g, err := strconv.ParseUint(group, 10, 32); err == nil {
		return uint32(g), nil
	}
	for _, f := range readColon("/etc/group") { // name:x:gid:members
		if len(f) >= 3 && f[0] == group {
			if g, err := strconv.ParseUint(f[2], 10, 32); err == nil {
				return uint32(g), nil
			}
		}
	}
	return 0, fmt.Errorf("no group %q in the sandbox's /etc/group: give a group it has, or a gid", group)
}

// readColon reads a colon-separated file of the sandbox's: the agent
// owns it, so only a regular file, and only its first 4 MiB (a fifo or
// a huge file must not stall the init, which serves every request).
func readColon(path string) [][]string {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil
	}
	defer f.Close()
	if fi, err := f.Stat(); err != nil || !fi.Mode().IsRegular() {
		return nil
	}
	var out [][]string
	sc := bufio.NewScanner(io.LimitReader(f, 4<<20))
	for sc.Scan() {
		if line := sc.Text(); line != "" && !strings.HasPrefix(line, "#") {
			out = append(out, strings.Split(line, ":"))
		}
	}
	return out
}

// asUser is env with HOME, USER and LOGNAME the account's.
func asUser(env []string, a account) []string {
	out := make([]string, 0, len(env)+3)
	for _, kv := range env {
		k, _, _ := strings.Cut(kv, "=")
		if k != "HOME" && k != "USER" && k != "LOGNAME" {
			out = append(out, kv)
		}
	}
	return append(out, "HOME="+a.home, "USER="+a.name, "LOGNAME="+a.name)
}
