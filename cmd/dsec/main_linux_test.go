package main

import (
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rogpeppe/go-internal/testscript"

	"github.com/dsec-project/dsec/internal/e2b/e2btest"
	"github.com/dsec-project/dsec/internal/layer/layertest"
	"github.com/dsec-project/dsec/internal/runtime/container"
	"github.com/dsec-project/dsec/internal/runtime/driver/microvms/agent"
	"github.com/dsec-project/dsec/internal/runtime/driver/microvms/vmm"
	"github.com/dsec-project/dsec/internal/runtime/microvm/microvmtest"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
	"github.com/dsec-project/dsec/internal/testenv"
)

func TestMain(m *testing.M) {
	full := func() {
		container.MaybeInit() // sandboxes' inits are this command re-executed
		vmm.MaybeRun()        // a microVM's shim
		agent.MaybeRun()      // its guest's agent
		os.Exit(Main(os.Args[1:], os.Stdin, os.Stdout, os.Stderr))
	}
	// dsecd: what the client build (client_linux_test.go) hands over to.
	// dsec-init: the name a sandbox's init runs under.
	// dsec-vmm: the name a microVM's shim runs under.
	testscript.Main(m, map[string]func(){"dsec": full, "dsecd": full, container.InitName: full, vmm.VMMName: full})
}

// TestScripts runs the CLI scripts in testdata/script.
func TestScripts(t *testing.T) {
	testscript.Run(t, scriptParams("testdata/script", nil))
}

// TestScriptsPacked runs the scripts that build, mount, run on, snapshot
// and import layers again with every layer packed into shared chunks as
// it is added (dsec layer dedup): each must pass on packed layers as on
// whole ones.
func TestScriptsPacked(t *testing.T) {
	t.Setenv("DSEC_STORE_DEDUP", "1")
	p := scriptParams("", nil)
	for _, n := range []string{"layer", "mount", "sandbox", "snap", "image", "microvm", "grade"} {
		p.Files = append(p.Files, filepath.Join("testdata/script", n+".txtar"))
	}
	testscript.Run(t, p)
}

// scriptParams runs the scripts in dir, each with a root of its own that
// must be left clean; setup, if not nil, adds to each script's env.
func scriptParams(dir string, setup func(*testscript.Env) error) testscript.Params {
	return testscript.Params{
		Dir: dir,
		Setup: func(env *testscript.Env) error {
			env.Setenv("DSEC_ROOT", filepath.Join(env.WorkDir, "root"))
			env.Setenv("HOME", filepath.Join(env.WorkDir, "home"))
			env.Setenv("DSEC_CONFIG", "")
			if v := os.Getenv("DSEC_STORE_DEDUP"); v != "" {
				env.Setenv("DSEC_STORE_DEDUP", v) // every script again, its layers packed
			}
			python, _ := filepath.Abs("../../python") // the Python SDK, for python.txtar
			env.Setenv("DSEC_PYTHON", python)
			e2bTests, _ := filepath.Abs("../../internal/e2b/testdata") // the E2B SDK's, for e2b.txtar
			env.Setenv("DSEC_E2B_TESTS", e2bTests)
			e2bExamples, _ := filepath.Abs("../../examples/e2b") // for e2b_example.txtar
			env.Setenv("DSEC_E2B_EXAMPLES", e2bExamples)
			clean, _ := filepath.Abs("../../scripts/clean.sh") // make clean's, for stop.txtar
			env.Setenv("DSEC_CLEAN", clean)
			env.Defer(func() {
				stopWorkers(env.WorkDir)
				cleanMounts(env.WorkDir)
				// What a script left running (sandboxes outlive a
				// stopped worker) is removed, and anything that
				// survives that is a leak.
				roots, _ := filepath.Glob(filepath.Join(env.WorkDir, "*", "sandboxes"))
				for _, r := range roots {
					runtimetest.Clean(filepath.Dir(r))
					if l := runtimetest.Leftovers(filepath.Dir(r)); len(l) > 0 {
						env.T().Fatal(fmt.Sprintf("left behind under %s: %v", filepath.Dir(r), l))
					}
				}
			})
			if setup != nil {
				return setup(env)
			}
			return nil
		},
		Condition: func(cond string) (bool, error) {
			if cond == "root" {
				if os.Geteuid() != 0 && testenv.MustRun() {
					return false, errors.New("this script needs root, and CI must run it: run the tests as root")
				}
				return os.Geteuid() == 0, nil
			}
			if cond == "packed" { // TestScriptsPacked: every layer packed as it is added
				return os.Getenv("DSEC_STORE_DEDUP") == "1", nil
			}
			if cond == "microvm" { // a guest kernel (make kernel)
				_, _, err := microvmtest.Find()
				if err != nil && testenv.MustRun() {
					return false, err
				}
				return err == nil, nil
			}
			return false, errors.New("unknown condition " + cond)
		},
		Cmds: map[string]func(ts *testscript.TestScript, neg bool, args []string){
			"exitcode": cmdExitCode,
			"mkbusybox": func(ts *testscript.TestScript, neg bool, args []string) {
				ts.Check(layertest.MakeBusyboxRoot(ts.MkAbs(args[0])))
			},
			"mktree": cmdMkTree,
			// leftovers ROOT: nothing of ROOT's sandboxes is on the
			// host (its worker gone): no process, group, mount, loop
			// device or sandbox directory.
			"leftovers": func(ts *testscript.TestScript, neg bool, args []string) {
				if len(args) != 1 {
					ts.Fatalf("usage: leftovers ROOT")
				}
				root := ts.MkAbs(args[0])
				left := append(runtimetest.Processes(root), runtimetest.Leftovers(root)...)
				switch {
				case len(left) > 0 && !neg:
					ts.Fatalf("left of %s's sandboxes:\n%s", root, strings.Join(left, "\n"))
				case len(left) == 0 && neg:
					ts.Fatalf("nothing left of %s's sandboxes", root)
				}
			},
			// microvm: the microvm backend's guest kernel and agent for
			// the workers the script starts (DSEC_MICROVM_KERNEL and
			// DSEC_MICROVM_AGENT); [microvm] says whether there is a
			// kernel (under CI a missing one fails).
			"microvm": func(ts *testscript.TestScript, neg bool, args []string) {
				kernel, agent, err := microvmtest.Find()
				ts.Check(err)
				ts.Setenv("DSEC_MICROVM_KERNEL", kernel)
				ts.Setenv("DSEC_MICROVM_AGENT", agent)
			},
			// debianroot VAR: VAR is a Debian root file system
			// (layertest.DebianRoot: debootstrap'd once, cached).
			"debianroot": func(ts *testscript.TestScript, neg bool, args []string) {
				root, err := layertest.DebianRoot()
				ts.Check(err)
				ts.Setenv(args[0], root)
			},
			// e2bsdk VERSION VAR: VAR is the node_modules of e2b@VERSION
			// (e2btest.Install: from npm once, cached).
			"e2bsdk": func(ts *testscript.TestScript, neg bool, args []string) {
				mods, err := e2btest.Install(args[0])
				ts.Check(err)
				ts.Setenv(args[1], mods)
			},
			// freeport VAR: VAR is a loopback address nothing listens on.
			"freeport": func(ts *testscript.TestScript, neg bool, args []string) {
				l, err := net.Listen("tcp", "127.0.0.1:0")
				ts.Check(err)
				ts.Setenv(args[0], l.Addr().String())
				l.Close()
			},
			// waittcp ADDR: wait until something listens on ADDR.
			"waittcp": func(ts *testscript.TestScript, neg bool, args []string) {
				for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(20 * time.Millisecond) {
					if c, err := net.Dial("tcp", args[0]); err == nil {
						c.Close()
						return
					}
					if time.Now().After(deadline) {
						ts.Fatalf("nothing listens on %s after 20 s", args[0])
					}
				}
			},
			// setenvfile VAR FILE: VAR is FILE's first line.
			"setenvfile": func(ts *testscript.TestScript, neg bool, args []string) {
				b, err := os.ReadFile(ts.MkAbs(args[1]))
				ts.Check(err)
				line, _, _ := strings.Cut(string(b), "\n")
				ts.Setenv(args[0], line)
			},
			// authregistry VAR: a registry on 127.0.0.1 that refuses
			// every request for want of credentials; VAR is its address.
			"authregistry": func(ts *testscript.TestScript, neg bool, args []string) {
				srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					w.Header().Set("WWW-Authenticate", `Basic realm="test"`)
					http.Error(w, `{"errors":[{"code":"UNAUTHORIZED","message":"authentication required"}]}`, http.StatusUnauthorized)
				}))
				ts.Defer(srv.Close)
				ts.Setenv(args[0], strings.TrimPrefix(srv.URL, "http://"))
			},
			// registryimages VAR: a registry on 127.0.0.1 (VAR its
			// address) holding busybox images built with umoci:
			// env:base (APP=base, workdir /srv), and env:tools and
			// env:fresh, a layer each over env:base's, and env:user,
			// whose layer adds the user app (uid 1000), its USER;
			// env:tools again as library/env:tools (Docker Hub's
			// env:tools, for a mirror of docker.io), and env:big, a
			// layer of 6 MiB of random bytes (/big/f000) over env:base's;
			// env:arm, env:base's content for linux/arm64; VAR_STORE is
			// the address as the store's tags name it.
			"registryimages": func(ts *testscript.TestScript, neg bool, args []string) {
				exe, err := layertest.Registry()
				ts.Check(err)
				addr, stop, err := layertest.RunRegistry(exe, ts.MkAbs("registry"), "")
				ts.Check(err)
				ts.Defer(stop)
				l, err := layertest.NewLayout(ts.MkAbs("layout"))
				ts.Check(err)
				ts.Check(l.Layer("", "base", func(root string) error {
					if err := layertest.MakeBusyboxRoot(root); err != nil {
						return err
					}
					return os.Mkdir(filepath.Join(root, "srv"), 0o755)
				}))
				ts.Check(l.Umoci("config", "--image", l.Dir+":base", "--config.env", "APP=base", "--config.env", "PATH=/bin", "--config.workingdir", "/srv"))
				for _, tag := range []string{"tools", "fresh"} {
					ts.Check(l.Layer("base", tag, func(root string) error {
						return os.WriteFile(filepath.Join(root, tag), []byte(tag+"\n"), 0o644)
					}))
				}
				ts.Check(l.Layer("base", "user", func(root string) error {
					if err := os.MkdirAll(filepath.Join(root, "home/app"), 0o700); err != nil {
						return err
					}
					if err := os.Chown(filepath.Join(root, "home/app"), 1000, 1000); err != nil {
						return err
					}
					return os.WriteFile(filepath.Join(root, "etc/passwd"), []byte("root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000::/home/app:/bin/sh\n"), 0o644)
				}))
				ts.Check(l.Umoci("config", "--image", l.Dir+":user", "--config.user", "app"))
				for _, tag := range []string{"base", "tools", "fresh", "user"} {
					ts.Check(l.Push(addr, "env", tag))
				}
				ts.Check(l.Push(addr, "library/env", "tools")) // docker.io/library/env:tools, through a mirror
				// env:arm: env:base's content, its config saying linux/arm64
				ts.Check(l.Umoci("tag", "--image", l.Dir+":base", "arm"))
				ts.Check(l.Umoci("config", "--image", l.Dir+":arm", "--architecture", "arm64"))
				ts.Check(l.Push(addr, "env", "arm"))
				ts.Check(l.Layer("base", "big", func(root string) error { return layertest.RandomTree(filepath.Join(root, "big"), "big", 1, 6<<20) }))
				ts.Check(l.Push(addr, "env", "big"))
				ts.Setenv(args[0], addr)
				ts.Setenv(args[0]+"_STORE", strings.Replace(addr, ":", "_", 1)) // as its store tags name it
			},
			// stallproxy VAR ADDR: a proxy in front of the registry at
			// ADDR (VAR its address) that serves half of every blob over
			// 1 MiB asked for whole, and then nothing until its client
			// goes: a pull in the middle of a layer, to be killed there.
			"stallproxy": func(ts *testscript.TestScript, neg bool, args []string) {
				if len(args) != 2 {
					ts.Fatalf("usage: stallproxy VAR ADDR")
				}
				target, err := url.Parse("http://" + args[1])
				ts.Check(err)
				proxy := httputil.NewSingleHostReverseProxy(target)
				proxy.FlushInterval = -1
				proxy.ErrorLog = log.New(io.Discard, "", 0)
				proxy.ModifyResponse = func(resp *http.Response) error {
					if strings.Contains(resp.Request.URL.Path, "/blobs/") && resp.Request.Header.Get("Range") == "" && resp.ContentLength > 1<<20 {
						resp.Body = &stallingBody{ReadCloser: resp.Body, left: resp.ContentLength / 2, done: resp.Request.Context().Done()}
					}
					return nil
				}
				srv := httptest.NewServer(proxy)
				ts.Defer(srv.Close)
				ts.Setenv(args[0], strings.TrimPrefix(srv.URL, "http://"))
			},
			"mkarchive": func(ts *testscript.TestScript, neg bool, args []string) {
				if len(args) != 2 {
					ts.Fatalf("usage: mkarchive docker|oci|tar FILE")
				}
				var b []byte
				switch args[0] {
				case "docker":
					b = layertest.DockerArchive(layertest.FlattenLayers...)
				case "oci":
					b = layertest.OCIArchive(true, layertest.FlattenLayers...)
				case "tar":
					b = layertest.FlattenLayers[0]
				default:
					ts.Fatalf("unknown archive kind %s", args[0])
				}
				ts.Check(os.WriteFile(ts.MkAbs(args[1]), b, 0o644))
			},
			"truncate": func(ts *testscript.TestScript, neg bool, args []string) {
				n, err := strconv.Atoi(args[1])
				ts.Check(err)
				ts.Check(os.Truncate(ts.MkAbs(args[0]), int64(n)))
			},
		},
	}
}

// exitcode N CMD ARGS... runs CMD and checks it exits with N.
func cmdExitCode(ts *testscript.TestScript, neg bool, args []string) {
	if len(args) < 2 {
		ts.Fatalf("usage: exitcode N CMD [ARGS...]")
	}
	want, err := strconv.Atoi(args[0])
	ts.Check(err)
	err = ts.Exec(args[1], args[2:]...)
	got := 0
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		got = ee.ExitCode()
	} else if err != nil {
		ts.Fatalf("%v", err)
	}
	if got != want {
		ts.Fatalf("%s exited %d, want %d", args[1], got, want)
	}
}

// mktree DIR makes a small tree with a file, a symlink and a hard link.
func cmdMkTree(ts *testscript.TestScript, neg bool, args []string) {
	dir := ts.MkAbs(args[0])
	ts.Check(os.MkdirAll(filepath.Join(dir, "etc"), 0o755))
	ts.Check(os.WriteFile(filepath.Join(dir, "etc", "hostname"), []byte("sandbox\n"), 0o644))
	ts.Check(os.WriteFile(filepath.Join(dir, "run.sh"), []byte("#!/bin/sh\necho hi\n"), 0o755))
	ts.Check(os.Symlink("run.sh", filepath.Join(dir, "start")))
	ts.Check(os.Link(filepath.Join(dir, "run.sh"), filepath.Join(dir, "again.sh")))
	ts.Check(layertest.Touch(dir))
}

// stopWorkers kills the workers the script's dsec commands started on
// demand (by the pid they wrote) and removes the sandboxes they left.
func stopWorkers(dir string) {
	pids, _ := filepath.Glob(filepath.Join(dir, "*", "worker.pid"))
	for _, p := range pids {
		b, _ := os.ReadFile(p)
		if pid, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil {
			unix.Kill(pid, unix.SIGKILL)
			for i := 0; i < 200 && unix.Kill(pid, 0) == nil; i++ {
				time.Sleep(5 * time.Millisecond)
			}
		}
		runtimetest.Clean(filepath.Dir(p))
	}
}

// cleanMounts undoes what a failed script left mounted below dir: layer
// mounts first, then fetchers' FUSE mounts; the fetchers then exit.
func cleanMounts(dir string) {
	b, _ := os.ReadFile("/proc/self/mountinfo")
	var erofs, fuse []string
	for _, line := range strings.Split(string(b), "\n") {
		pre, post, ok := strings.Cut(line, " - ")
		f, g := strings.Fields(pre), strings.Fields(post)
		if !ok || len(f) < 5 || len(g) < 1 || !strings.HasPrefix(f[4], dir+"/") {
			continue
		}
		if strings.HasPrefix(g[0], "fuse") {
			fuse = append(fuse, f[4])
		} else {
			erofs = append(erofs, f[4])
		}
	}
	for _, m := range append(erofs, fuse...) {
		unix.Unmount(m, unix.MNT_DETACH)
	}
	pids, _ := filepath.Glob(filepath.Join(dir, "*", "cache", "*", "fetcher.pid"))
	for _, p := range pids {
		b, _ := os.ReadFile(p)
		if pid, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil {
			unix.Kill(pid, unix.SIGTERM)
		}
	}
}

// stallingBody reads left bytes of a body, then waits until done.
type stallingBody struct {
	io.ReadCloser
	left int64
	done <-chan struct{}
}

func (b *stallingBody) Read(p []byte) (int, error) {
	if b.left <= 0 {
		<-b.done
		return 0, io.ErrUnexpectedEOF
	}
	if int64(len(p)) > b.left {
		p = p[:b.left]
	}
	n, err := b.ReadCloser.Read(p)
	b.left -= int64(n)
	return n, err
}
