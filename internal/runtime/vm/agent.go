package vm

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/dsec-project/dsec/internal/runtime/initproto"
)

// The guest agent in a VM image: dsec's agent (the dsec-init binary, in
// its guest role) runs in the guest as a service of the guest's own init,
// systemd, and speaks to the host over a virtio-serial port, as a
// microVM's agent does. The image holds only the units that start it;
// the binary comes with every boot on a read-only disk of the host's
// (AgentDiskSerial), so an image outlives the dsec that built it and the
// agent is always the worker's own version.
//
// What an image of another operating system would need (a Windows or
// Android guest): nothing of this tree but a service that opens the port
// AgentPort and speaks the protocol; the firmware and the disk are
// already the guest's own.

// AgentSystemd is Disk.Agent for an image whose systemd starts the agent.
const AgentSystemd = "systemd"

// AgentDiskSerial is the serial of the virtio disk holding the agent,
// which udev names /dev/disk/by-id/virtio-SERIAL in the guest.
const AgentDiskSerial = "dsec-agent"

// AgentBinary is the agent's file name on its disk.
const AgentBinary = "dsec-init"

// AgentEnv is the environment the agent's service runs the binary
// with: it is a full VM's agent (initproto.GuestEnv).
const AgentEnv = initproto.GuestEnv + "=" + initproto.GuestSystem

// AgentUnits are the units the image build writes into the root file
// system's /etc/systemd/system: a mount of the agent's disk, and the
// agent's service, wanted by multi-user.target.
var AgentUnits = map[string]string{
	"run-dsec-agent.mount": `[Unit]
Description=dsec guest agent's disk
DefaultDependencies=no
Before=local-fs.target

[Mount]
What=/dev/disk/by-id/virtio-` + AgentDiskSerial + `
Where=/run/dsec/agent
Type=ext4
Options=ro,nodev,nosuid
`,
	"dsec-agent.service": `[Unit]
Description=dsec guest agent
RequiresMountsFor=/run/dsec/agent

[Service]
Environment=` + AgentEnv + `
ExecStart=/run/dsec/agent/` + AgentBinary + `
KillMode=process
TasksMax=infinity

[Install]
WantedBy=multi-user.target
`,
}

// hasSystemd says whether tree boots systemd.
func hasSystemd(tree string) bool {
	for _, p := range []string{"usr/lib/systemd/systemd", "lib/systemd/systemd"} {
		if fi, err := os.Stat(filepath.Join(tree, p)); err == nil && fi.Mode().IsRegular() {
			return true
		}
	}
	return false
}

// inTree says whether path (relative to the root) is in tree.
func inTree(tree string) func(string) bool {
	return func(path string) bool {
		_, err := os.Lstat(filepath.Join(tree, path))
		return err == nil
	}
}

// installAgent writes AgentUnits into the root file system at p of the
// disk at path, with debugfs (nothing mounted), and enables the service;
// exists says what the file system holds (paths relative to its root).
func installAgent(ctx context.Context, path string, p Partition, exists func(string) bool) error {
	for name := range AgentUnits {
		if exists("etc/systemd/system/" + name) {
			return fmt.Errorf("the tree has its own /etc/systemd/system/%s: dsec installs its agent's units under that name: remove it from the tree", name)
		}
	}
	tmp, err := os.MkdirTemp("", "dsec-units-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	var cmds []string
	for _, d := range []string{"etc", "etc/systemd", "etc/systemd/system", "etc/systemd/system/multi-user.target.wants"} {
		if !exists(d) {
			cmds = append(cmds, "mkdir /"+d)
		}
	}
	for name, text := range AgentUnits {
		f := filepath.Join(tmp, name)
		if err := os.WriteFile(f, []byte(text), 0o644); err != nil {
			return err
		}
		if err := os.Chmod(f, 0o644); err != nil { // not the umask's
			return err
		}
		cmds = append(cmds, fmt.Sprintf("write %s /etc/systemd/system/%s", f, name))
	}
	cmds = append(cmds, "symlink /etc/systemd/system/multi-user.target.wants/dsec-agent.service /etc/systemd/system/dsec-agent.service")
	script := filepath.Join(tmp, "cmds")
	if err := os.WriteFile(script, []byte(strings.Join(cmds, "\n")+"\n"), 0o600); err != nil {
		return err
	}
	return debugfs(ctx, fmt.Sprintf("%s?offset=%d", path, p.Offset), script)
}

// debugfs runs the commands in script on the ext4 file system dev,
// writable. debugfs exits 0 whatever its commands do: what it says on
// stderr beyond its banner is a command's failure.
func debugfs(ctx context.Context, dev, script string) error {
	cmd := exec.CommandContext(ctx, "debugfs", "-w", "-f", script, dev)
	cmd.Env = append(os.Environ(), "E2FSPROGS_FAKE_TIME=1")
	var stderr strings.Builder
	cmd.Stderr = &stderr
	err := cmd.Run()
	if errors.Is(err, exec.ErrNotFound) {
		return fmt.Errorf("install the guest agent: debugfs is missing: install e2fsprogs (make deps does)")
	}
	var complaints []string
	for line := range strings.Lines(stderr.String()) {
		if line = strings.TrimSpace(line); line != "" && !strings.HasPrefix(line, "debugfs ") {
			complaints = append(complaints, line)
		}
	}
	if err != nil || len(complaints) > 0 {
		return fmt.Errorf("install the guest agent: debugfs: %v %s", err, strings.Join(complaints, "; "))
	}
	return nil
}
